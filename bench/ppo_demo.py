"""PPO with a critic on CPU at one completion per prompt: the embedded task from the SFT warm start,
against GRPO (groups of 16) from the same start. Prints a table.

    PYTHONPATH=. .venv/bin/python bench/ppo_demo.py [--steps 400] [--critic-lr 1e-3] [key=value ...]

1. The warm start: configs/sft/tiny_cpu.yaml's export (trained first when missing, as `make grpo`).
2. GRPO: configs/grpo/tiny_cpu.yaml as it is (64 prompts x 16 samples a rollout, groups without
   reward spread skipped, 512 episodes a step), kept and reused from OUTPUT/grpo when complete.
3. PPO: the same config with `rollout.group_size: 1` and 512 prompts a rollout (512 episodes a
   step, as GRPO trains), GAE advantages from a critic (`rollout.advantage: gae`, the value model
   initialised from the warm start) and `trainer.loss: ppo` with GRPO's clip range. The same
   learning rate, sampling temperature and evals otherwise.

Both run the actor app. The table gives the held-out greedy accuracy at each eval and each run's
gain over the warm start. The `key=value` overrides go to both runs (e.g. `eval.every=10`).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from apps.grpo.main import main as run_app

from app_runs import curve, read_rows

CONFIG = "configs/grpo/tiny_cpu.yaml"


def accuracies(output_dir: Path) -> dict[int, float]:
    """Held-out accuracy by step, at each eval of a finished run (empty: no run there yet)."""
    return {step: accuracy for step, accuracy, _ in curve(read_rows(output_dir))}


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--critic-lr", type=float, default=1e-3, help="critic.optimizer.lr")
    parser.add_argument("--lam", type=float, default=0.95, help="critic.lam (GAE's lambda)")
    parser.add_argument("--output", default="runs/ppo_demo")
    args, overrides = parser.parse_known_args()
    out = Path(args.output)

    grpo_dir = out / "grpo"
    if max(accuracies(grpo_dir), default=-1) < args.steps:
        run_app(["--config", CONFIG, f"output_dir={grpo_dir}", f"max_steps={args.steps}", *overrides])
    grpo = accuracies(grpo_dir)

    ppo_dir = out / f"ppo_{args.steps}_lr{args.critic_lr:g}_lam{args.lam:g}"
    run_app(
        [
            "--config",
            CONFIG,
            f"output_dir={ppo_dir}",
            f"max_steps={args.steps}",
            "rollout.group_size=1",
            "rollout.prompts_per_step=512",
            # A group of one has no reward spread: every group would be skipped.
            "rollout.skip_groups_without_signal=false",
            "rollout.advantage=gae",
            f"critic={{optimizer: {{lr: {args.critic_lr}}}, value_clip: 0.2, gamma: 1.0, lam: {args.lam}}}",
            "trainer.loss={name: ppo, clip_low: 0.2, clip_high: 0.28}",
            *overrides,
        ]
    )
    ppo = accuracies(ppo_dir)

    print(
        f"\nPPO with a critic at group_size 1 against GRPO (group_size 16), {args.steps} steps from the warm start"
    )
    print("| run | start acc | final acc | gain |")
    print("|---|---:|---:|---:|")
    for name, by_step in (("GRPO, groups of 16", grpo), ("PPO + critic, group_size 1", ppo)):
        start, final = by_step[min(by_step)], by_step[max(by_step)]
        print(f"| {name} | {start:.3f} | {final:.3f} | {final - start:+.3f} |")
    print("\n| step | GRPO acc | PPO acc |")
    print("|---:|---:|---:|")
    for step in sorted(ppo):
        shown = f"{grpo[step]:.3f}" if step in grpo else "-"
        print(f"| {step} | {shown} | {ppo[step]:.3f} |")


if __name__ == "__main__":
    main()
