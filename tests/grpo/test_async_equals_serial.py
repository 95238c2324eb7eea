"""async == sync: with max_policy_age 0, one rollout loop and a seed, the actor pipeline is the
serial recipe, step for step; and two runs of the app with one seed log the same losses.

Equality is bit-exact, not to a tolerance: both sides run the same float32 CPU kernels on one
thread (actor_threads: 1; the serial recipe sets the same), the same engines, the same
seeded per-(prompt, sample) draws and the same buffer sampling, so every operation sees the
same inputs in the same order. Weights travel through the store as exact copies. (The one
reduction order that differs, the metric logger's merge of per-process means, reduces a
single value per step here.)
"""

import json

from apps.grpo.config import GRPOConfig
from apps.grpo.main import main

from forge.config import load_config
from forge.recipes.grpo_serial import grpo_serial

SYNC = [
    "seed=3",
    "actor_threads=1",
    "rollout.threads=1",
    "rollout.skip_groups_without_signal=true",
    "replay_buffer.max_policy_age=0",
    "eval.every=0",
]
COMPARED = ("train/loss", "loss/pg", "loss/kl", "loss/ratio_mean", "train/grad_norm", "buffer/sampled_reward")


def _losses(path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{key: row[key] for key in ("step", *COMPARED)} for row in rows]


def test_app_in_sync_mode_equals_the_serial_recipe_and_repeats(write_grpo_config, tmp_path):
    config = write_grpo_config()
    main(["--config", str(config), *SYNC])
    first = _losses(tmp_path / "run" / "metrics.jsonl")
    main(["--config", str(config), *SYNC, f"output_dir={tmp_path / 'again'}"])
    again = _losses(tmp_path / "again" / "metrics.jsonl")
    assert len(first) == 3 and again == first

    serial = grpo_serial(load_config(GRPOConfig, config, SYNC))
    assert [{key: row[key] for key in ("step", *COMPARED)} for row in serial["metrics"]] == first
    # The steps did train (the compared values are not all constants).
    assert len({row["train/loss"] for row in first}) == 3
