"""A checkpoint the trainer cannot represent, or that the config contradicts, is refused before
any process starts: one short message naming the key or architecture, both values and what
to do, exit code 2, and no run directory (the app makes it first thing once it starts)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from apps.grpo.main import main as grpo_main
from apps.sft.main import main as sft_main
from hf_checkpoints import make_checkpoint
from startup_errors import startup_error
from transformers import GPT2Config, GPT2LMHeadModel, Qwen3MoeConfig, Qwen3MoeForCausalLM

from forge.data.tokenizer import embedded_tokenizer
from forge.engines.titan.checkpoint_model import check_model_section
from forge.engines.titan.config import ModelConfig

SFT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "sft" / "tiny_cpu.yaml"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("refusals")


@pytest.fixture(scope="module")
def qwen3(root) -> Path:
    return make_checkpoint(root, "qwen3_untied")


def edited(source: Path, dest: Path, **settings) -> Path:
    """A copy of ``source`` whose config.json has ``settings`` changed."""
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, **settings}))
    return dest


def saved(model, path: Path) -> Path:
    model.save_pretrained(path)
    embedded_tokenizer().save_pretrained(path)
    return path


def refused(capsys, write_grpo_config, policy: Path, *overrides: str, generator: Path | None = None) -> str:
    config = write_grpo_config(policy=policy, flavor=None)
    argv = ["--config", str(config), *overrides]
    if generator is not None:
        argv.append(f"generator.model_path={generator}")
    err = startup_error(grpo_main, capsys, argv)
    assert len(err.splitlines()) == 1, err
    assert not (config.parent / "run").exists(), "the run started"
    return err


def test_unsupported_architectures_are_named_with_the_supported_ones(root, write_grpo_config, capsys):
    torch.manual_seed(0)
    moe = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    err = refused(capsys, write_grpo_config, saved(Qwen3MoeForCausalLM(moe), root / "moe"))
    assert "Qwen3MoeForCausalLM" in err and "not supported by the trainer" in err
    assert "Qwen2ForCausalLM" in err and "LlamaForCausalLM" in err
    gpt2 = GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2)
    err = refused(capsys, write_grpo_config, saved(GPT2LMHeadModel(gpt2), root / "gpt2"))
    assert "GPT2LMHeadModel" in err and "Qwen3ForCausalLM" in err


def test_config_keys_that_contradict_the_checkpoint(qwen3, write_grpo_config, capsys):
    err = refused(capsys, write_grpo_config, qwen3, "trainer.engine.model.name=llama3")
    assert "trainer.engine.model.name is 'llama3'" in err and "Qwen3ForCausalLM" in err

    # The tiny flavor is tied and sized otherwise: every difference is listed.
    err = refused(capsys, write_grpo_config, qwen3, "trainer.engine.model.flavor=tiny")
    assert "trainer.engine.model.flavor 'tiny' (qwen3) disagrees with" in err
    assert "tie_word_embeddings True vs False" in err and "head_dim 16 vs 32" in err

    err = refused(capsys, write_grpo_config, qwen3, "trainer.engine.model.vocab_size=55")
    assert "trainer.engine.model.vocab_size is 55" in err and "vocab_size 64 (embedding rows)" in err


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic'"),
    ],
)
def test_settings_the_trainer_cannot_represent(qwen3, root, write_grpo_config, capsys, settings, named):
    policy = edited(qwen3, root / f"edited-{len(list(root.iterdir()))}", **settings)
    err = refused(capsys, write_grpo_config, policy)
    assert named in err and "cannot represent" in err


def test_a_tokenizer_with_more_tokens_than_rows(root, write_grpo_config, capsys):
    tokenizer_size = len(embedded_tokenizer())
    policy = edited(make_checkpoint(root / "small", "qwen3_tied"), root / "few_rows", vocab_size=40)
    # The weights must agree with config.json, or that is what gets refused.
    from safetensors.torch import load_file, save_file

    weights = load_file(policy / "model.safetensors")
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:40].clone()
    save_file(weights, policy / "model.safetensors", metadata={"format": "pt"})
    err = refused(capsys, write_grpo_config, policy)
    assert f"has {tokenizer_size} tokens but the model at" in err and "40 embedding rows" in err


def test_fewer_tokens_than_rows_is_accepted(qwen3):
    rows = json.loads((qwen3 / "config.json").read_text())["vocab_size"]
    assert len(embedded_tokenizer()) < rows
    check_model_section(
        ModelConfig(hf_path=str(qwen3)), "trainer.engine.model", len(embedded_tokenizer()), "tok"
    )


def test_a_generator_on_another_model(qwen3, root, write_grpo_config, capsys):
    other = edited(qwen3, root / "other_theta", rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    err = refused(capsys, write_grpo_config, qwen3, generator=other)
    assert "are different models" in err and "rope_theta 1000000.0 vs 10000.0" in err


def test_sft_refuses_before_start(root, capsys):
    moe = edited(
        make_checkpoint(root / "sft", "llama3"), root / "sft_moe", architectures=["MixtralForCausalLM"]
    )
    run_dir = root / "sft_run"
    argv = ["--config", str(SFT_CONFIG), f"run_dir={run_dir}", f"trainer.engine.model.hf_path={moe}"]
    argv.append("~trainer.engine.model.flavor")
    err = startup_error(sft_main, capsys, argv)
    assert "MixtralForCausalLM" in err and "not supported by the trainer" in err
    assert not (run_dir / "checkpoints").exists()
