"""The real GRPO loop for a few steps: every actor in its own process, the real store."""

import json
import time

import psutil
from apps.grpo.main import main


def _children_after(timeout: float) -> list[psutil.Process]:
    deadline = time.time() + timeout
    while True:
        children = [
            c for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE
        ]
        if not children or time.time() > deadline:
            return children
        time.sleep(0.2)


def test_few_steps_of_the_real_loop(write_grpo_config, tmp_path):
    config = write_grpo_config()
    history = main(["--config", str(config)])

    assert [s for s, _ in history["eval_accuracy"]] == [0, 1, 2, 3]

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        # Every trained episode was produced by a policy at most max_policy_age (1) versions old.
        assert row["buffer/policy_age_max"] <= 1
        assert row["grpo/trained_policy_age_max"] <= 1
        for key in (
            "loss/pg",
            "loss/kl",
            "loss/ratio_mean",
            "loss/clip_frac_low",
            "train/grad_norm",
            "train/lr",
            "generator/tokens_per_s",
            "generator/weight_sync_ms",
            "reward/total",
            "rollout/reward",
            "buffer/size",
            "grpo/weight_sync_ms",
            "grpo/wait_batch_ms",
            "eval/accuracy",
            # Eval at step s asks for version s: the generator pulls every version.
            "weight_sync/pull_bytes",
            "weight_sync/pull_gb_per_s",
        ):
            assert key in row, f"metrics row of step {row['step']} has no '{key}'"
    # Each publish is stored in the background and reports its size and speed.
    published = [r for r in rows if "weight_sync/publish_s" in r]
    assert published and all(r["weight_sync/publish_bytes"] > 0 for r in published)
    assert (tmp_path / "run" / "config.yaml").exists()
    # Shutdown stopped every actor process.
    assert _children_after(15) == []
