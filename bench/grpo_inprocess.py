"""The serial GRPO recipe (forge.recipes.grpo_serial) on a GRPO config, in this process: for
choosing a config's settings quickly. Prints held-out greedy accuracy and reward as a table.

    .venv/bin/python bench/grpo_inprocess.py --config configs/grpo/tiny_cpu.yaml max_steps=300 \
        trainer.engine.optimizer.lr=3e-4 rollout.prompts_per_step=64 rollout.group_size=16
"""

import logging
import time

from forge.config import parse_args
from forge.grpo.config import GRPOConfig
from forge.grpo.warm_start import ensure_warm_start
from forge.recipes.grpo_serial import grpo_serial


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    cfg = parse_args(GRPOConfig, description=__doc__.splitlines()[0])
    ensure_warm_start(cfg, print)
    started = time.perf_counter()
    seconds = {}
    history = grpo_serial(
        cfg, on_step=lambda step, row: seconds.setdefault(step, time.perf_counter() - started)
    )
    rewards = {row["step"]: row.get("buffer/sampled_reward", float("nan")) for row in history["metrics"]}
    print(
        f"serial GRPO, {cfg.max_steps} steps of {cfg.replay_buffer.batch_size} episodes from {cfg.policy_path}"
    )
    print("| step | held-out greedy accuracy | trained reward | seconds |")
    print("|---:|---:|---:|---:|")
    for step, accuracy in history["eval_accuracy"]:
        print(
            f"| {step} | {accuracy:.3f} | {rewards.get(step, float('nan')):.3f} | {seconds.get(step, 0.0):.0f} |"
        )


if __name__ == "__main__":
    main()
