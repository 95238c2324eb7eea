"""The trainer with FSDP over 2 GPUs against one GPU on the same batches (issue 22, run 3).

    PYTHONPATH=src:. python bench/fsdp_parity.py --out DIR [--config configs/grpo/gpu_demo.yaml]
        [--steps 5] [--procs 2] [override ...]

1. The GRPO app with `trainer.procs=PROCS`, every actor colocated (`provisioner.colocate=true`:
   the generator shares the trainer's first GPU), the KL term on (`beta=0.05`, so the reference
   model runs with the trainer's parallelism), every episode and training batch recorded.
2. Replays of those batches (`rollout.replay_from`, `forge.recipes.grpo_replay`) from the same
   initial policy, on 1 process and on PROCS: the same episodes per step, regrouped for 1 rank.
3. A table of `train/loss` per step: the recorded run, both replays, and the largest difference
   between 1 and PROCS processes. The overrides after the options apply to every run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def app(config: str, out: Path, overrides: list[str]) -> list[dict]:
    command = [sys.executable, "-m", "apps.grpo.main", "--config", config, f"output_dir={out}", *overrides]
    subprocess.run(command, check=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(rows: list[dict]) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", default="configs/grpo/gpu_demo.yaml")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--procs", type=int, default=2)
    args, overrides = parser.parse_known_args()
    common = [f"max_steps={args.steps}", "eval.every=0", "checkpoint.every=0", *overrides]
    recorded = args.out / "record"
    runs = {
        f"recorded, {args.procs} procs": app(
            args.config,
            recorded,
            [
                f"trainer.procs={args.procs}",
                "provisioner.colocate=true",
                "trainer.loss.beta=0.05",
                "metrics.rollouts_every=1",
                *common,
            ],
        )
    }
    replay = [f"rollout.replay_from={recorded / 'rollouts.jsonl'}", "trainer.loss.beta=0.05", *common]
    for procs in (1, args.procs):
        runs[f"replay, {procs} procs"] = app(
            args.config, args.out / f"replay_{procs}", [f"trainer.procs={procs}", *replay]
        )
    table = {name: losses(rows) for name, rows in runs.items()}
    one, many = table["replay, 1 procs"], table[f"replay, {args.procs} procs"]
    print("| step | " + " | ".join(table) + f" | abs(1 - {args.procs} procs) |")
    print("|---|" + "---:|" * (len(table) + 1))
    for step in sorted(one):
        cells = [f"{values[step]:.6e}" if step in values else "-" for values in table.values()]
        print(f"| {step} | " + " | ".join(cells) + f" | {abs(one[step] - many[step]):.2e} |")
    (args.out / "losses.json").write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
