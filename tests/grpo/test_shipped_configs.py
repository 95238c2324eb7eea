"""Every shipped config runs: each GRPO config in configs/ for 2 steps on CPU, its model swapped
for the tiny test policy by command-line overrides and everything else as shipped.

What only a config's own keys can break (a generator dtype the trainer does not publish in, a
loss horizon, a reward function, a microbatch size) is then caught here, in CI, rather than on
a GPU machine. SFT configs are run by tests/apps/test_sft_app.py.
"""

import json
from pathlib import Path

import pytest
from apps.grpo.main import main

from forge.data.tokenizer import embedded_tokenizer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RUN_ELSEWHERE = {
    "sft/tiny_cpu.yaml": "tests/apps/test_sft_app.py",
    "sft/gpu_demo.yaml": "tests/apps/test_sft_app.py",
}

# Only what makes a run tiny: the model, the sizes, the number of steps.
SMALL = [
    "max_steps=2",
    "trainer.engine.model.flavor=tiny",
    f"trainer.engine.model.vocab_size={len(embedded_tokenizer())}",
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
    # Colocated on one GPU as shipped; on a CPU machine colocation places nothing.
    "grpo/gpu_demo.yaml": ["dataset.toy_task.num_train=64", "dataset.toy_task.num_eval=8"],
    "grpo/qwen3_1_7b.yaml": [
        "dataset.path={prompts}",
        "dataset.eval_path={prompts}",
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


@pytest.mark.parametrize("name", shipped("grpo"))
def test_grpo_config_runs_two_steps(name, tiny_policy, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{a}+{a}=", "target": str(2 * a)}) + "\n" for a in range(40))
    )
    out = tmp_path / "run"
    overrides = [o.format(prompts=prompts) for o in SMALL + EXTRA[name]]
    history = main(
        ["--config", str(CONFIGS / name), f"policy_path={tiny_policy}", f"output_dir={out}", *overrides]
    )
    # eval.every=1: the eval after step s runs on version s, so every version reached the generator.
    assert [s for s, _ in history["eval_accuracy"]] == [0, 1, 2]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0: the initial eval
    assert all(r["weight_sync/pull_bytes"] > 0 for r in rows[1:])
