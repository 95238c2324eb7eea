"""One GRPO step of the serial recipe on a checkpoint, for checks that the trainer recomputes
the logprobs the generator sampled with (on-policy: the ratio is 1 and the mismatch KL 0)."""

from pathlib import Path

from forge.grpo.config import GRPOConfig
from forge.recipes.grpo_serial import grpo_serial


def assert_one_step_is_on_policy(policy: Path, out: Path) -> None:
    """The native engine samples from `policy` and the trainer, starting from the same
    checkpoint, trains one step on those samples."""
    cfg = GRPOConfig.model_validate(
        {
            "policy_path": str(policy),
            "output_dir": str(out),
            "max_steps": 1,
            "dataset": {"toy_task": {"num_train": 16, "num_eval": 4}},
            "generator": {"model_path": str(policy), "sampling": {"max_tokens": 8, "temperature": 1.0}},
            "trainer": {"engine": {"model": {"hf_path": str(policy)}, "training": {"seq_len": 64}}},
            "rollout": {"prompts_per_step": 2, "group_size": 4, "skip_groups_without_signal": False},
            "replay_buffer": {"batch_size": 8},
            "eval": {"every": 0},
            "metrics": {"console": False},
        }
    )
    (row,) = grpo_serial(cfg)["metrics"]
    assert row["loss/mismatch_kl"] < 1e-6, row
    assert row["train/tokens"] > 0 and row["loss/ratio_max"] < 1 + 1e-4, row
