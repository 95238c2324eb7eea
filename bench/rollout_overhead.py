"""A rollout loop's own work after its generate call, at the `trl` preset's size (64 prompts x 8
samples x 256 new tokens, 64-token prompts): the controller's scoring and group advantages, its
buffer add and the trainer's batch sample, against real reward, advantages and replay-buffer
actors in their own processes; and pickling the generate call's reply there and back (what
Monarch does with it). Prints a table of the rounds after the first (which warms the actors).

    PYTHONPATH=src:. python bench/rollout_overhead.py [--rounds 4]

On the GPU machines a replica starts a rollout only every 7.4-7.6 s while its calls take
5.8-6.4 s (bench/RESULTS.md, twenty-first session); this says how much of that gap the loop's
own calls can be.
"""

from __future__ import annotations

import argparse
import asyncio
import pickle
import random
import statistics
import time

from forge.actors.advantages import ComputeAdvantages
from forge.actors.replay_buffer import ReplayBuffer
from forge.actors.reward import RewardActor, RewardConfig
from forge.controller import shutdown
from forge.data.types import Completion
from forge.replay_buffer import ReplayBufferConfig
from forge.rewards.sources import RewardFunctions, RolloutScorer
from forge.rollout.step import score_groups

PROMPTS, SAMPLES, PROMPT_TOKENS, NEW_TOKENS = 64, 8, 64, 256


def trl_sized_groups(rng: random.Random) -> list[list[Completion]]:
    return [
        [
            Completion(
                prompt="12+30=" * 10,
                prompt_ids=list(range(PROMPT_TOKENS)),
                response_ids=[rng.randrange(151_936) for _ in range(NEW_TOKENS)],
                logprobs=[-rng.random() for _ in range(NEW_TOKENS)],
                text="4 2 " * (NEW_TOKENS // 4),
                stop_reason="length",
                policy_version=0,
            )
            for _ in range(SAMPLES)
        ]
        for _ in range(PROMPTS)
    ]


async def measure(rounds: int) -> dict[str, list[float]]:
    groups = trl_sized_groups(random.Random(0))
    rows = [{"target": "42", "index": i} for i in range(PROMPTS)]
    reward, advantages, buffer = await asyncio.gather(
        RewardActor.as_actor(RewardConfig()),
        ComputeAdvantages.as_actor("grpo"),
        ReplayBuffer.as_actor(ReplayBufferConfig(batch_size=PROMPTS * SAMPLES), 0),
    )
    scorer = RolloutScorer([RewardFunctions.of(RewardConfig(), reward.evaluate_groups.route)])
    times: dict[str, list[float]] = {"reply pickled there and back": [], "score": [], "add": [], "sample": []}
    try:
        for round_ in range(rounds + 1):
            started = time.perf_counter()
            pickle.loads(pickle.dumps(groups))
            pickled = time.perf_counter()
            scored = await score_groups(rows, groups, scorer, advantages)
            score_done = time.perf_counter()
            await buffer.add_many.route([e for g in scored for e in g])
            added = time.perf_counter()
            await buffer.sample.route(0)
            sampled = time.perf_counter()
            if round_:  # the first warms the actors up
                for key, seconds in zip(
                    times,
                    (pickled - started, score_done - pickled, added - score_done, sampled - added),
                    strict=True,
                ):
                    times[key].append(seconds)
    finally:
        await shutdown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    times = asyncio.run(measure(args.rounds))
    print(f"| stage ({PROMPTS} x {SAMPLES} x {NEW_TOKENS} tokens) | median ms | max ms |")
    print("|---|---:|---:|")
    for stage, seconds in times.items():
        print(f"| {stage} | {statistics.median(seconds) * 1e3:.0f} | {max(seconds) * 1e3:.0f} |")


if __name__ == "__main__":
    main()
