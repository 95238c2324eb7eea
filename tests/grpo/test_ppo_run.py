"""PPO with a critic end to end, in one app run: one completion per prompt (group_size 1), GAE
over the critic's values with the KL penalty in the token rewards (the reference model on),
trainer.loss ppo. The run trains the policy and the critic and records the critic's metrics; in
sync mode it equals the serial recipe bit for bit; and its critic, SIGKILLed after the step-2
checkpoint, comes back from that checkpoint (max_restarts 1) to the same numbers, so that a
resume covers the critic's weights and optimizer."""

import json
import os
import re

import pytest
from processes import run_killing_after_checkpoint

from forge.config import load_config
from forge.grpo.config import GRPOConfig
from forge.recipes.grpo_replay import load_replay_batches
from forge.recipes.grpo_serial import grpo_serial
from forge.rl.batch import PolicyBatch

pytestmark = pytest.mark.slow

# The reward runs in the reward actor's process, which imports it by module path.
REWARDS_MODULE = """
def by_characters(prompt, response, target):
    return sum(map(ord, response)) % 7 / 7  # varies between samples even for a random policy
"""
# Sync mode (see tests/grpo/test_grpo_durable.py): one rollout loop, no stale episodes, one
# thread per process, so the app is the serial recipe step for step.
PPO = [
    "seed=4",
    "max_steps=4",
    "actor_threads=1",
    "rollout.threads=1",
    "replay_buffer.max_policy_age=0",
    "checkpoint.every=2",
    "eval.every=0",
    "rollout.group_size=1",
    "rollout.advantage=gae",
    "rollout.kl_coef=0.05",
    "~rollout.skip_groups_without_signal",
    "trainer.loss={name: ppo}",
    "critic={optimizer: {lr: 0.003}, gamma: 1.0, lam: 0.9}",
]
# What each step trained on (the explained variance is recorded when a rollout is scored, which
# may fall in another step's row than in the recipe's).
COMPARED = (
    "train/loss",
    "loss/pg",
    "train/grad_norm",
    "buffer/sampled_reward",
    "critic/value_loss",
    "critic/values",
    "critic/grad_norm",
)


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_ppo_run_trains_its_critic_equals_the_serial_recipe_and_resumes_it(
    write_grpo_config, tmp_path, monkeypatch
):
    folder = tmp_path / "rewards_module"
    folder.mkdir()
    (folder / "ppo_rewards.py").write_text(REWARDS_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))
    config = write_grpo_config(reward="{functions: [{name: 'ppo_rewards:by_characters'}]}")
    serial = grpo_serial(load_config(GRPOConfig, config, [*PPO, "output_dir=unused"]))["metrics"]

    run = tmp_path / "run"
    argv = ["--config", str(config), *PPO, f"output_dir={run}"]
    returncode, output = run_killing_after_checkpoint(
        [*argv, "max_restarts=1", "restart_backoff_s=0"], run, "Critic"
    )
    assert returncode == 0, output[-3000:]
    assert re.search(r"error: actor Critic_\d+ died", output), output[-3000:]
    assert "resume: continuing after step 2" in output
    # The checkpoint holds the critic's state beside the trainer's.
    assert (run / "checkpoints" / "step_00000004" / "critic").is_dir()

    rows = read_rows(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["run/restarts"] for r in rows] == [0, 0, 1, 1]
    # The critic trained every step, from its zero head (values 0 at the first step) onwards.
    assert rows[0]["critic/values"] == 0.0 and all(r["critic/values"] != 0.0 for r in rows[1:])
    assert all(r["critic/value_loss"] > 0 and r["critic/grad_norm"] > 0 for r in rows)
    assert any("critic/explained_variance" in r for r in rows)
    assert all(r["reference/forward_s"] > 0 for r in rows if "reference/forward_s" in r)
    # The trained advantages are GAE's per token, and the batches carry the critic's values and
    # the returns, recorded for replay.
    [first_rank] = load_replay_batches(run / "rollouts.jsonl")[-1]
    batch = PolicyBatch.from_episodes(first_rank, pad_id=0)
    assert batch.advantages.shape == batch.values.shape == batch.returns.shape == batch.loss_mask.shape
    assert batch.values.abs().sum() > 0 and batch.returns.abs().sum() > 0

    assert len({r["critic/value_loss"] for r in serial}) == 4  # not a comparison of constants
    for want, got in zip(serial, rows, strict=True):
        for key in COMPARED:
            assert got[key] == want[key], f"step {want['step']}: {key} {got[key]} != {want[key]} (serial)"
