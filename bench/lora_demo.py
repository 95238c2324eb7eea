"""LoRA against full fine-tuning on the CPU demo (`make grpo`): the same GRPO run from the same
SFT warm start, once training every weight and once training only LoRA adapters (synced to the
generator as adapters). Prints a table.

    PYTHONPATH=. .venv/bin/python bench/lora_demo.py [--rank 32 --alpha 64 --lr 1e-3] [key=value ...]

The tiny model's layers are 64 wide, so rank 32 adapts half of each projection's rank. LoRA
takes a larger learning rate than full fine-tuning (the demo's 3e-4): its update is the small
product B A. The `key=value` overrides go to both runs. Each run's table row gives the held-out
greedy accuracy at the start and the end, the gain, the seconds of train steps (the sum of
`grpo/step_s`) and of the whole command, and the bytes each weight sync published.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from apps.grpo.main import main as run_app

from app_runs import curve, read_rows

CONFIG = "configs/grpo/tiny_cpu.yaml"


def run(output_dir: Path, overrides: list[str]) -> float:
    """Runs the demo into `output_dir` (a fresh start); its wall-clock seconds."""
    started = time.perf_counter()
    run_app(["--config", CONFIG, f"output_dir={output_dir}", "resume=false", *overrides])
    return time.perf_counter() - started


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--alpha", type=float, default=64)
    parser.add_argument("--lr", type=float, default=1e-3, help="the LoRA run's learning rate")
    parser.add_argument("--output", default="runs/lora_demo")
    args, overrides = parser.parse_known_args()
    out = Path(args.output)
    lora = [
        f"trainer.engine.lora.rank={args.rank}",
        f"trainer.engine.lora.alpha={args.alpha}",
        f"trainer.engine.optimizer.lr={args.lr}",
    ]
    arms = {"full fine-tuning (lr 3e-4)": (out / "full", overrides)}
    arms[f"LoRA rank {args.rank}, alpha {args.alpha:g} (lr {args.lr:g})"] = (
        out / "lora",
        [*lora, *overrides],
    )
    wall = {name: run(output_dir, arm_overrides) for name, (output_dir, arm_overrides) in arms.items()}

    print("\n| run | start acc | final acc | gain | train s | command s | MB a sync |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    curves = {}
    for name, (output_dir, _) in arms.items():
        rows = read_rows(output_dir)
        curves[name] = points = curve(rows)
        published = [r["weight_sync/publish_bytes"] for r in rows if "weight_sync/publish_bytes" in r]
        sync_mb = f"{published[-1] / 1e6:.3f}" if published else "-"
        start, final, seconds = points[0][1], points[-1][1], points[-1][2]
        print(
            f"| {name} | {start:.3f} | {final:.3f} | {final - start:+.3f} | {seconds:.0f} | {wall[name]:.0f} | {sync_mb} |"
        )
    names = list(curves)
    print(f"\n| step | {names[0]} | {names[1]} |")
    print("|---:|---:|---:|")
    by_step = [{step: accuracy for step, accuracy, _ in curves[name]} for name in names]
    for step in sorted(by_step[0]):
        print(f"| {step} | {by_step[0][step]:.3f} | {by_step[1].get(step, float('nan')):.3f} |")


if __name__ == "__main__":
    main()
