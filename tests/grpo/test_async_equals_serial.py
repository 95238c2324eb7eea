"""async == sync: with max_policy_age 0, one rollout loop and a seed, the actor pipeline is the
serial recipe, step for step. (That two runs of the app with one seed log the same numbers is
shown by tests/grpo/test_grpo_durable.py, which compares a killed and resumed run with an
uninterrupted one.)

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
    # Row 0 holds the initial eval only: the serial recipe has no such row.
    return [{key: row[key] for key in ("step", *COMPARED)} for row in rows if row["step"] > 0]


def test_app_in_sync_mode_equals_the_serial_recipe(write_grpo_config, tmp_path):
    config = write_grpo_config()
    main(["--config", str(config), *SYNC])
    app = _losses(tmp_path / "run" / "metrics.jsonl")
    assert len(app) == 3

    serial = grpo_serial(load_config(GRPOConfig, config, SYNC))
    assert [{key: row[key] for key in ("step", *COMPARED)} for row in serial["metrics"]] == app
    assert len({row["train/loss"] for row in app}) == 3
