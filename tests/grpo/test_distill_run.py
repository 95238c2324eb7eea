"""On-policy distillation end to end: the app with a teacher (another tiny checkpoint with the
policy's tokenizer) and no reward function trains on the teacher's signal alone, records the
reverse KL to the teacher every step, and in sync mode equals the serial recipe bit for bit.
The run takes REINFORCE++'s advantages (rollout.advantage: reinforce_pp, with no group
advantages actor), which with no rewards are 0, and one sample a prompt (group_size 1), so that
one app run covers those paths too."""

import json

import pytest
from apps.grpo.main import main

from forge.config import load_config
from forge.grpo.config import GRPOConfig
from forge.recipes.grpo_replay import load_replay_batches
from forge.recipes.grpo_serial import grpo_serial
from forge.rl.batch import PolicyBatch

pytestmark = pytest.mark.slow

# Sync mode (see tests/grpo/test_grpo_durable.py): one rollout loop, no stale episodes, one
# thread per process, so the app is the serial recipe step for step.
DISTILL = [
    "seed=5",
    "max_steps=2",
    "trainer.loss.beta=0.0",
    "actor_threads=1",
    "rollout.threads=1",
    "replay_buffer.max_policy_age=0",
    "reward.functions=[]",
    "eval.every=0",
    "distill.weight=2.0",
    "rollout.advantage=reinforce_pp",
    "rollout.group_size=1",  # a baseline of the batch, not of a group: one sample a prompt will do
    # The teacher in processes of its own (the killed-trainer test in test_grpo_durable.py has one
    # beside the trainer).
    "distill.gpu=own",
]
COMPARED = ("train/loss", "loss/pg", "train/grad_norm", "buffer/sampled_reward")


@pytest.fixture(scope="module")
def distill_run(grpo_config_factory, tiny_teacher):
    config = grpo_config_factory()
    overrides = [*DISTILL, f"distill.teacher_path={tiny_teacher}"]
    history = main(["--config", str(config), *overrides])
    return config, overrides, history


def test_a_teacher_run_with_no_reward_trains_on_the_teachers_signal(distill_run):
    config, overrides, history = distill_run
    run = config.parent / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and history["eval_accuracy"] == []
    # The teacher scored every rollout, and no reward function was there to give a signal.
    assert all(r["distill/reverse_kl"] > 0 and r["teacher/forward_s"] > 0 for r in rows), rows
    assert all(r["buffer/sampled_reward"] == 0 and r["train/grad_norm"] > 0 for r in rows)
    # The trained advantages are the teacher's per-token ones, recorded for replay exactly.
    [first_rank] = load_replay_batches(run / "rollouts.jsonl")[0]
    batch = PolicyBatch.from_episodes(first_rank, pad_id=0)
    assert batch.advantages.shape == batch.loss_mask.shape and batch.advantages.abs().sum() > 0


def test_the_teacher_run_in_sync_mode_equals_the_serial_recipe(distill_run):
    config, overrides, _ = distill_run
    app = [json.loads(line) for line in (config.parent / "run" / "metrics.jsonl").read_text().splitlines()]
    serial = grpo_serial(load_config(GRPOConfig, config, [*overrides, "output_dir=unused"]))["metrics"]
    assert len({r["train/loss"] for r in serial}) == 2  # not a comparison of constants
    for want, got in zip(serial, app, strict=True):
        for key in COMPARED:
            assert got[key] == want[key], f"step {want['step']}: {key} {got[key]} != {want[key]} (serial)"
