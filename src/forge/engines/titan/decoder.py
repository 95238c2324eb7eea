"""The trainer's model for a Hugging Face checkpoint: torchtitan's Qwen3 decoder, generalised.

Qwen3, Qwen2/2.5 and Llama 3.x are one decoder with a few switches: q/k norms (Qwen3),
attention biases (Qwen2: q/k/v; ``attention_bias`` of Llama and Qwen3: q/k/v/o), tied
embeddings, and the RoPE variant. torchtitan's Qwen3 model already rotates halves as
transformers does (its Llama 3 model uses interleaved complex RoPE and permuted q/k weights),
so its weights load under Hugging Face names unchanged. This module adds the biases and
computes the RoPE frequencies with transformers' own functions (default, linear, llama3, yarn),
so a checkpoint's ``rope_scaling`` is applied exactly as transformers and vLLM apply it.

Registered as the train spec ``hf_decoder``; `forge.engines.titan.checkpoint_model` builds
its arguments from a checkpoint's ``config.json``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torchtitan.models.qwen3 import get_train_spec as qwen3_train_spec
from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
from torchtitan.models.qwen3.model.model import Qwen3Model, precompute_rope_cache
from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.train_spec import register_train_spec

TRAIN_SPEC_NAME = "hf_decoder"


@dataclass
class DecoderModelArgs(Qwen3ModelArgs):
    qkv_bias: bool = False
    output_bias: bool = False
    # The checkpoint's config.json (its `rope_parameters` decide the RoPE frequencies); None
    # means plain RoPE with `rope_theta`.
    hf_config: dict[str, Any] | None = field(default=None, repr=False)


def rope_frequencies(hf_config: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention scaling) as transformers computes them for this config."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.for_model(**hf_config)
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, 1.0
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class DecoderModel(Qwen3Model):
    def __init__(self, model_args: DecoderModelArgs):
        super().__init__(model_args)
        for block in self.layers.values():
            attention = block.attention
            if model_args.qkv_bias:
                for name in ("wq", "wk", "wv"):
                    linear = getattr(attention, name)
                    setattr(attention, name, nn.Linear(linear.in_features, linear.out_features, bias=True))
            if model_args.output_bias:
                wo = attention.wo
                attention.wo = nn.Linear(wo.in_features, wo.out_features, bias=True)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        super().init_weights(buffer_device)
        # The checkpoint overwrites them; zero is what a fresh model starts from.
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def _precompute_rope_cache(self) -> torch.Tensor:
        args = self.model_args
        if args.hf_config is None:
            return precompute_rope_cache(args.head_dim, args.max_seq_len, args.rope_theta)
        # Computed on the CPU even while the model is built on the meta device (transformers'
        # functions copy values), then placed where the model is being built.
        with torch.device("cpu"):
            inv_freq, scaling = rope_frequencies(args.hf_config)
            positions = torch.arange(args.max_seq_len, dtype=torch.float32)
            angles = torch.outer(positions, inv_freq)
            angles = torch.cat([angles, angles], dim=-1)
            # The layout torchtitan's apply_rotary_emb reads: [cos | sin] along the last dim.
            cache = torch.cat([angles.cos() * scaling, angles.sin() * scaling], dim=-1)
        return cache.to(torch.get_default_device())


class DecoderStateDictAdapter(Qwen3StateDictAdapter):
    """Qwen3's name map plus the attention biases."""

    def __init__(self, model_args: DecoderModelArgs, hf_assets_path: str | None):
        super().__init__(model_args, hf_assets_path)
        for hf_name, titan_name in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"), ("o_proj", "wo")):
            self.from_hf_map[f"model.layers.{{}}.self_attn.{hf_name}.bias"] = (
                f"layers.{{}}.attention.{titan_name}.bias"
            )

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        # Qwen3's adapter adds a tied lm_head into the caller's dict; keep the caller's intact.
        return super().from_hf(dict(hf_state_dict))


def register() -> None:
    spec = qwen3_train_spec()
    register_train_spec(
        TRAIN_SPEC_NAME,
        dataclasses.replace(
            spec,
            model_cls=DecoderModel,
            model_args={},
            state_dict_adapter=DecoderStateDictAdapter,
        ),
    )


register()
