"""What writing rollout records costs the rollout loop.

The GRPO controller hands each rollout step's episodes to `RolloutRecorder.record_groups`
(building the record dicts is all the loop pays directly); a background thread serialises
them to JSON and writes. The thread shares the controller's GIL, so the honest measure is
how much longer an asyncio loop that looks like the rollout loop (awaits that stand for
actor calls, plus the controller's own bookkeeping) takes with the recorder than without.

    python bench/rollout_records_bench.py              # the demo's and a GPU run's shapes
    python bench/rollout_records_bench.py --steps 3    # quick check

Rows: `shape` (prompts x group size, prompt and response tokens), `episodes/step`,
`every` (metrics.rollouts_every), `record ms/step` (the call in the loop), `writer ms/step` (the thread's serialise+write),
`MB/step` (file growth), `loop s/step` without and with the recorder, and the slowdown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
import uuid

from forge.data.types import Completion, Episode
from forge.rollout.records import RolloutRecorder, episode_record

# name, prompts per step, group size, prompt tokens, response tokens, seconds per rollout
# step, metrics.rollouts_every (the demo config keeps one group in 16)
SHAPES = [
    ("demo tiny_cpu (64x16, 8+6 tok)", 64, 16, 8, 6, 0.8, 1),
    ("demo tiny_cpu (64x16, 8+6 tok)", 64, 16, 8, 6, 0.8, 16),
    ("GPU 0.6B (256x8, 64+256 tok)", 256, 8, 64, 256, 10.0, 1),
]


def make_groups(prompts: int, group_size: int, prompt_len: int, response_len: int) -> list[list[Episode]]:
    rng = random.Random(0)
    groups = []
    for p in range(prompts):
        group_id = uuid.uuid4().hex
        prompt_ids = [rng.randrange(50_000) for _ in range(prompt_len)]
        group = []
        for _ in range(group_size):
            response = [rng.randrange(50_000) for _ in range(response_len)]
            logprobs = [-rng.random() * 3 for _ in range(response_len)]
            completion = Completion(
                f"prompt {p}", prompt_ids, response, logprobs, "x" * response_len, "stop", 3
            )
            group.append(
                Episode(
                    completion,
                    "target",
                    group_id,
                    reward=rng.random(),
                    reward_breakdown={"r": 1.0},
                    advantage=rng.gauss(0, 1),
                    ref_logprobs=list(logprobs),
                )
            )
        groups.append(group)
    return groups


async def rollout_loop(groups, steps: int, step_s: float, recorder: RolloutRecorder | None) -> float:
    """`steps` rollout steps: 20 awaits standing for actor calls, then the buffer hand-off."""
    started = time.perf_counter()
    for _ in range(steps):
        for _ in range(20):
            await asyncio.sleep(step_s / 20)
        if recorder is not None:
            recorder.record_groups(groups)
    return (time.perf_counter() - started) / steps


def measure(name, prompts, group_size, prompt_len, response_len, step_s, every, steps, scale) -> dict:
    step_s *= scale
    groups = make_groups(prompts, group_size, prompt_len, response_len)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rollouts.jsonl")
        plain = asyncio.run(rollout_loop(groups, steps, step_s, None))
        recorder = RolloutRecorder(path, every)
        recorded = asyncio.run(rollout_loop(groups, steps, step_s, recorder))
        call_started = time.perf_counter()
        recorder.record_groups(groups)
        record_ms = (time.perf_counter() - call_started) * 1e3
        recorder.close()
        size = os.path.getsize(path) / (steps + 1)
    # What the writer thread does per step, timed here on the same records.
    started = time.perf_counter()
    "".join(json.dumps(episode_record(0, e)) + "\n" for g in groups[::every] for e in g)
    writer_ms = (time.perf_counter() - started) * 1e3
    return {
        "shape": name,
        "episodes/step": prompts * group_size,
        "every": every,
        "record ms/step": record_ms,
        "writer ms/step": writer_ms,
        "MB/step": size / 1e6,
        "loop s/step (no records)": plain,
        "loop s/step (records)": recorded,
        "slowdown": recorded / plain - 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies each shape's step time")
    args = parser.parse_args()
    rows = [measure(*shape, args.steps, args.scale) for shape in SHAPES]
    print(f"rollout records, {args.steps} steps per shape (machine load: {os.getloadavg()[0]:.1f})")
    print("| " + " | ".join(rows[0]) + " |")
    print("|---|" + "---:|" * (len(rows[0]) - 1))
    for row in rows:
        cells = [
            f"{v:.1%}" if k == "slowdown" else (f"{v:.3f}" if isinstance(v, float) else str(v))
            for k, v in row.items()
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
