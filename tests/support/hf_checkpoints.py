"""Checkpoints made by transformers' own classes, as a user brings them: tiny sizes, random
weights, embedding rows padded past the tokenizer (as Qwen's are), and norm weights perturbed
so that a wrong eps or a wrong tying shows in the logits."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from forge.data.tokenizer import embedded_tokenizer

# More rows than the embedded tokenizer's 55 tokens.
ROWS = 64
# head_dim 32: vLLM's CPU attention refuses 16.
_SIZES = dict(
    vocab_size=ROWS,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=512,
)
_LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# Qwen3's released settings (transformers' Qwen3Config defaults to another rope_theta).
_QWEN3 = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6)
# name -> (config class, model class, settings beyond _SIZES)
CHECKPOINTS = {
    "qwen3_tied": (Qwen3Config, Qwen3ForCausalLM, dict(_QWEN3, tie_word_embeddings=True)),
    "qwen3_untied": (Qwen3Config, Qwen3ForCausalLM, dict(_QWEN3, tie_word_embeddings=False)),
    "qwen3_rope_theta": (Qwen3Config, Qwen3ForCausalLM, dict(rope_theta=10_000.0, rms_norm_eps=1e-5)),
    "qwen3_yarn": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(
            _QWEN3,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        ),
    ),
    "qwen2_5": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=False, rope_theta=1_000_000.0)),
    "llama3_1": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(rope_theta=500_000.0, rms_norm_eps=1e-5, rope_scaling=_LLAMA31_SCALING),
    ),
    "llama3": (LlamaConfig, LlamaForCausalLM, dict(rope_theta=500_000.0, rms_norm_eps=1e-5)),
    "llama3_2": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            rope_theta=500_000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_scaling={**_LLAMA31_SCALING, "factor": 32.0},
        ),
    ),
}
# Sampling defaults a Qwen3 checkpoint ships; an export must keep them.
GENERATION_DEFAULTS = dict(temperature=0.6, top_p=0.95, top_k=20, do_sample=True)


def make_checkpoint(
    root: Path, name: str, seed: int = 0, dtype: torch.dtype = torch.float32, rows: int = ROWS
) -> Path:
    """Saves checkpoint ``name`` of CHECKPOINTS with the embedded tokenizer and ``rows``
    vocabulary rows into ``root/name``."""
    config_cls, model_cls, settings = CHECKPOINTS[name]
    tokenizer = embedded_tokenizer()
    special = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = config_cls(**{**_SIZES, "vocab_size": rows}, **special, **settings)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:  # 1 everywhere would hide eps and tying mistakes
                param.uniform_(0.5, 1.5)
            elif param_name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    model.generation_config = GenerationConfig(
        **GENERATION_DEFAULTS,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
        **{k: v for k, v in special.items() if k != "eos_token_id"},
    )
    out = root / name
    model.to(dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def tiny_qwen3_config(vocab_size: int, eos_token_id: int | None, **overrides) -> Qwen3Config:
    """A tiny tied Qwen3 as engine tests use it: head_dim 32 (vLLM's CPU attention refuses 16),
    bos 1, pad 0; ``eos_token_id`` None leaves samples to run to max_tokens."""
    settings = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=eos_token_id,
        pad_token_id=0,
        architectures=["Qwen3ForCausalLM"],
    )
    return Qwen3Config(**{**settings, **overrides})


def make_padded_checkpoint(root: Path, rows: int = ROWS) -> Path:
    """``qwen3_untied`` (with ``rows`` vocabulary rows) with its output rows past the tokenizer
    scaled up 20 times: their logits dwarf the others wherever they are positive, so a sampler
    that kept them would pick them most of the time."""
    path = make_checkpoint(root, "qwen3_untied", rows=rows)
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"][len(embedded_tokenizer()) :] *= 20
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path
