"""Fixtures for GRPO tests: a tiny random policy exported as a local HF directory, and a config."""

from pathlib import Path

import pytest

from forge.data.tokenizer import embedded_tokenizer
from forge.engines.titan.config import TitanEngineConfig
from forge.engines.titan.engine import TitanEngine


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory) -> Path:
    return export_tiny_policy(tmp_path_factory.mktemp("tiny_policy"))


@pytest.fixture(scope="session")
def tiny_policy_hd32(tmp_path_factory) -> Path:
    """Like `tiny_policy` with head size 32, which vLLM's CPU attention accepts (16 it does not)."""
    return export_tiny_policy(tmp_path_factory.mktemp("tiny_policy_hd32"), flavor="tiny_hd32")


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory) -> Path:
    """Another tiny random policy (its own seed) with the same tokenizer: a teacher to distill."""
    return export_tiny_policy(tmp_path_factory.mktemp("tiny_teacher"), seed=1)


def export_tiny_policy(root: Path, seed: int = 0, flavor: str = "tiny") -> Path:
    """A randomly initialised tiny qwen3 with the embedded tokenizer, as transformers expects."""
    tokenizer = embedded_tokenizer()
    tokenizer_dir = root / "tokenizer"
    tokenizer.save_pretrained(tokenizer_dir)
    engine = TitanEngine(
        TitanEngineConfig.model_validate(
            {
                "model": {"flavor": flavor, "vocab_size": len(tokenizer)},
                "training": {"seed": seed, "seq_len": 64},
            }
        ),
        trainable=False,
    )
    return engine.export_hf(root / "policy", tokenizer_dir)


@pytest.fixture
def write_grpo_config(tiny_policy, tmp_path):
    """Writes a small GRPO config for `tiny_policy` and returns its path; `extra` adds lines."""

    def write(policy: Path = tiny_policy, flavor: str | None = "tiny", **extra: str) -> Path:
        path = tmp_path / "grpo.yaml"
        path.write_text(grpo_yaml(policy, tmp_path / "run", len(embedded_tokenizer()), flavor, **extra))
        return path

    return write


def grpo_yaml(policy: Path, out: Path, vocab_size: int, flavor: str | None = "tiny", **extra: str) -> str:
    """A small but complete GRPO config for tests (every actor, few steps). With ``flavor``
    None the trainer's model is the checkpoint's alone (no flavor or vocab_size named)."""
    named = "" if flavor is None else f"flavor: {flavor}, vocab_size: {vocab_size}, "
    lines = [
        f"policy_path: {policy}",
        f"output_dir: {out}",
        "max_steps: 3",
        "dataset: {toy_task: {num_train: 200, num_eval: 20}}",
        "generator: {model_path: '${policy_path}', sampling: {max_tokens: 4, temperature: 1.0}}",
        "trainer:",
        "  engine:",
        f"    model: {{{named}hf_path: '${{policy_path}}'}}",
        "    training: {seq_len: 64}",
        "    optimizer: {lr: 0.01}",
        "  loss: {name: grpo, beta: 0.05}",
        "rollout: {threads: 2, prompts_per_step: 2, group_size: 4, skip_groups_without_signal: false}",
        "replay_buffer: {batch_size: 8, max_policy_age: 1}",
        "eval: {every: 1, num_prompts: 8, max_tokens: 4}",
        f"metrics: {{console: false, jsonl_path: {out}/metrics.jsonl}}",
    ]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def grpo_config_factory(tiny_policy, tmp_path_factory):
    """`write_grpo_config` for module-scoped fixtures: each call writes into a fresh directory."""

    def write(**extra: str) -> Path:
        root = tmp_path_factory.mktemp("grpo")
        path = root / "grpo.yaml"
        path.write_text(grpo_yaml(tiny_policy, root / "run", len(embedded_tokenizer()), **extra))
        return path

    return write
