"""What every GRPO app run must show in its metrics, whatever its config: a row per step with the
metrics every step has, every version evaluated (eval.every=1), trained episodes no older than
max_policy_age, weights published and received, and no actor process left after it."""

import json
from pathlib import Path

import yaml
from processes import children_left

# What every step's metrics row has, whatever the config.
STEP_METRICS = (
    "loss/pg",
    "loss/ratio_mean",
    "loss/clip_frac_low",
    "train/grad_norm",
    "train/lr",
    "trainer/tokens_per_s",
    "trainer/forward_s",
    "generator/tokens_per_s",
    "generator/weight_sync_ms",
    "rollout/reward",
    "buffer/size",
    "grpo/weight_sync_ms",
    "grpo/wait_batch_ms",
    "eval/accuracy",
    "weight_sync/pull_bytes",
    "weight_sync/pull_gb_per_s",
)


def check_every_step(out: Path, history: dict, steps: int) -> list[dict]:
    """The checks above of the run in `out` (the app's returned `history`), which trained `steps`
    steps with eval.every=1; returns its metrics rows."""
    # eval.every=1: the eval after step s runs on version s, so every version reached the generator.
    assert [s for s, _ in history["eval_accuracy"]] == list(range(steps + 1))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps + 1))  # step 0: the initial eval
    config = yaml.safe_load((out / "config.yaml").read_text())
    max_age = config["replay_buffer"]["max_policy_age"]
    for row in rows[1:]:
        assert row["weight_sync/pull_bytes"] > 0
        # Every trained episode was produced by a policy at most max_policy_age versions old.
        assert row["buffer/policy_age_max"] <= max_age and row["grpo/trained_policy_age_max"] <= max_age
        missing = [key for key in STEP_METRICS if key not in row]
        assert not missing, f"metrics row of step {row['step']} has no {missing}"
    # Recorded by the rollout loops as they score, into the row of the flush that collects them:
    # on a loaded machine a step's rollout can land in the next step's row.
    assert any("reward/total" in row for row in rows[1:])
    # Each publish is stored in the background and reports its size and speed.
    published = [r for r in rows if "weight_sync/publish_s" in r]
    assert published and all(r["weight_sync/publish_bytes"] > 0 for r in published)
    # One host, weights in shared memory: the generator measures each version from the trainer's
    # publish to its load (the mean over replicas, and the last replica's). Through the store it
    # has no publish time to measure from.
    if config["generator"]["weight_transport"] != "store":
        ready = [r for r in rows if "generator/publish_to_ready_ms" in r]
        assert ready and all(
            r["generator/publish_to_ready_max_ms"] >= r["generator/publish_to_ready_ms"] > 0 for r in ready
        )
        # And each replica's, every one of them in the run, none above the last replica's.
        by_replica = {
            key: (row[key], row["generator/publish_to_ready_max_ms"])
            for row in ready
            for key in row
            if key.startswith("generator/replica_")
        }
        replicas = config["generator"].get("replicas", 1)
        assert {key.split("/")[1] for key in by_replica} == {f"replica_{i}" for i in range(replicas)}
        assert all(0 < value <= last for value, last in by_replica.values())
    # Shutdown stopped every actor process.
    assert children_left(15) == []
    return rows
