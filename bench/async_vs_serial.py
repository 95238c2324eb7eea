"""The serial GRPO recipe and the actor app on the same settings, one after the other in one
run: trained episodes per second, step time, the training loop's wait on weight sync and on
batches, and held-out greedy accuracy after the same number of trained episodes.

    PYTHONPATH=. .venv/bin/python bench/async_vs_serial.py --config configs/grpo/tiny_cpu.yaml max_steps=40

Any GRPO config and overrides work (the app's own, e.g. `replay_buffer.max_policy_age=0
rollout.threads=1` for the app in lockstep). Speed is measured over the steps after the
first (start-up) and without the last (held-out eval), from each step's `grpo/step_s`.
The last line is `async/serial episodes per second: X.XX`.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from pathlib import Path

from apps.grpo.main import main as run_app

from forge.config import parse_args, save_config
from forge.grpo.config import GRPOConfig
from forge.grpo.warm_start import ensure_warm_start
from forge.recipes.grpo_serial import grpo_serial


def summary(name: str, cfg: GRPOConfig, rows: list[dict], accuracy: float, wall_s: float) -> dict:
    timed = rows[1:-1] or rows
    step_s = statistics.mean(r["grpo/step_s"] for r in timed)
    return {
        "run": name,
        "episodes/s": cfg.replay_buffer.batch_size / step_s,
        "step s": step_s,
        "sync wait ms": statistics.mean(r.get("grpo/weight_sync_ms", 0.0) for r in timed),
        "batch wait ms": statistics.mean(r.get("grpo/wait_batch_ms", 0.0) for r in timed),
        "policy age": statistics.mean(r.get("buffer/policy_age_mean", 0.0) for r in timed),
        "held-out acc": accuracy,
        "wall s": wall_s,
    }


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    cfg = parse_args(GRPOConfig, description=__doc__.splitlines()[0])
    # Accuracy at the end only (and at step 0), so that evals do not weigh on the timed steps.
    cfg.eval.every = cfg.max_steps
    ensure_warm_start(cfg, print)
    load = os.getloadavg()

    started = time.perf_counter()
    serial = grpo_serial(cfg)
    serial_row = summary(
        "serial", cfg, serial["metrics"], serial["eval_accuracy"][-1][1], time.perf_counter() - started
    )
    print(f"serial: {serial_row}", flush=True)

    config_path = Path(cfg.output_dir) / "bench_config.yaml"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    save_config(cfg, config_path)
    started = time.perf_counter()
    history = run_app(["--config", str(config_path)])
    app_rows = [json.loads(line) for line in Path(cfg.metrics.jsonl_path).read_text().splitlines()]
    app_row = summary(
        "async app", cfg, app_rows, history["eval_accuracy"][-1][1], time.perf_counter() - started
    )

    print(
        f"\n{cfg.max_steps} steps x {cfg.replay_buffer.batch_size} episodes, {cfg.rollout.prompts_per_step} "
        f"prompts x {cfg.rollout.group_size} per rollout, rollout.threads {cfg.rollout.threads}, "
        f"max_policy_age {cfg.replay_buffer.max_policy_age}; load average before: "
        f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores"
    )
    columns = list(serial_row)
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in (serial_row, app_row):
        print("| " + " | ".join(v if isinstance(v, str) else f"{v:.3g}" for v in row.values()) + " |")
    print(f"async/serial episodes per second: {app_row['episodes/s'] / serial_row['episodes/s']:.2f}")


if __name__ == "__main__":
    main()
