"""The GRPO app with LoRA (`trainer.engine.lora`): the trainer publishes its merged weights, so the
generator samples exactly the policy the trainer scores, while the policy moves away from the
reference (the frozen base)."""

import json

import pytest
from apps.grpo.main import main

pytestmark = pytest.mark.slow


def test_generators_sample_the_merged_policy(grpo_config_factory):
    config = grpo_config_factory()
    # Episodes of the current policy only: a ratio away from 1 would be the sync's fault. Groups
    # with a learning signal only (seed 3 finds them), so that every step changes the adapters.
    main(
        [
            "--config",
            str(config),
            "trainer.engine.lora.rank=8",
            "seed=3",
            "replay_buffer.max_policy_age=0",
            "rollout.threads=1",
            "rollout.skip_groups_without_signal=true",
            "eval.every=0",
            "max_steps=2",
        ]
    )
    rows = [json.loads(line) for line in (config.parent / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss/mismatch_kl" in row]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        assert row["loss/mismatch_kl"] < 1e-6 and abs(row["loss/ratio_max"] - 1) < 1e-4, row
    # B starts at zero: the policy is the reference at step 1, then the adapters move it.
    assert steps[0]["loss/kl"] < 1e-9 < steps[1]["loss/kl"], steps
