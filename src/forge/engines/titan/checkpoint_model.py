"""The trainer's model settings, read from a Hugging Face checkpoint's ``config.json``.

A checkpoint a user brings is the source of truth for its model: sizes, heads, head_dim,
vocabulary rows, tying, RoPE (theta and scaling), norm eps, q/k norms and attention biases
all come from its ``config.json``. The run's config may still name them (``model.name``,
``model.flavor``, ``model.vocab_size``); where one disagrees with the checkpoint, or the
checkpoint has a setting the trainer cannot represent, we refuse before any process starts,
naming the key, both values and what to do. Everything here reads files only (the
``config.json`` and the safetensors headers), so it runs in the launching process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge.engines.titan.decoder import DecoderModelArgs

# Architecture (config.json `architectures`) -> the value of `model.name` that means it.
ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama3",
}
# RoPE variants whose frequencies transformers computes once (forge.engines.titan.decoder);
# "dynamic" rescales with the sequence length and "longrope" switches tables by length.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_SUPPORTED_TEXT = (
    f"Qwen3 (dense, tied or not), Qwen2 / Qwen2.5, Llama 3 / 3.1 / 3.2 / 3.3 ({', '.join(ARCHITECTURES)})"
)


class CheckpointModelError(ValueError):
    """A checkpoint the trainer cannot represent, or that disagrees with the run's config."""


@dataclass
class CheckpointModel:
    path: Path
    architecture: str
    name: str
    config: dict[str, Any]
    """config.json as transformers reads it (``rope_parameters`` filled in)."""
    model_args: DecoderModelArgs
    dtype: str
    """The weights' dtype as config.json declares it (the export's default)."""

    @property
    def context_length(self) -> int:
        return int(self.config["max_position_embeddings"])

    @property
    def settings(self) -> dict[str, Any]:
        return model_settings(self.model_args)


def read_config_json(path: str | Path) -> dict[str, Any]:
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no config.json, so it is not a Hugging Face model directory")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointModelError(f"{file} is not valid JSON ({error})") from None


def read_checkpoint_model(path: str | Path) -> CheckpointModel:
    """The trainer's model for the checkpoint at ``path``; refuses what it cannot represent."""
    from transformers import AutoConfig

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"Hugging Face checkpoint directory {path} does not exist (model.hf_path)")
    raw = read_config_json(path)
    architecture = _architecture(raw, path)
    config = AutoConfig.from_pretrained(path).to_dict()
    where = f"{path}/config.json"
    _refuse_unsupported(config, architecture, where)
    heads = config["num_attention_heads"]
    qwen2 = architecture == "Qwen2ForCausalLM"
    args = DecoderModelArgs(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        hidden_dim=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        norm_eps=config["rms_norm_eps"],
        rope_theta=float(config["rope_parameters"]["rope_theta"]),
        qk_norm=architecture == "Qwen3ForCausalLM",
        max_seq_len=config["max_position_embeddings"],
        enable_weight_tying=bool(config.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and none on o_proj; Llama and Qwen3 put
        # `attention_bias` on all four.
        qkv_bias=qwen2 or bool(config.get("attention_bias", False)),
        output_bias=not qwen2 and bool(config.get("attention_bias", False)),
        hf_config=config,
    )
    dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "float32")
    model = CheckpointModel(path, architecture, ARCHITECTURES[architecture], config, args, dtype)
    _check_weights_fit(model)
    return model


def model_settings(args) -> dict[str, Any]:
    """The settings that decide a model's function, named as in config.json: what a flavor and
    a checkpoint are compared on (context length is not among them: training uses seq_len)."""
    hf_config = getattr(args, "hf_config", None)
    if hf_config is not None:
        rope_type = hf_config["rope_parameters"].get("rope_type", "default")
    else:  # a flavor: torchtitan's llama3 always scales RoPE as Llama 3.1 does
        rope_type = "llama3" if hasattr(args, "rope_scaling_args") else "default"
    heads = args.n_heads
    return {
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": args.n_kv_heads or heads,
        "head_dim": getattr(args, "head_dim", None) or args.dim // heads,
        "intermediate_size": _intermediate_size(args),
        "rms_norm_eps": args.norm_eps,
        "rope_theta": float(args.rope_theta),
        "rope_type": rope_type,
        "tie_word_embeddings": bool(getattr(args, "enable_weight_tying", False)),
        "qk_norm": bool(getattr(args, "qk_norm", False)),
        "attention_bias": bool(getattr(args, "qkv_bias", False) or getattr(args, "output_bias", False)),
    }


def check_config_agrees(model_cfg, checkpoint: CheckpointModel, key: str) -> None:
    """Refuses the settings the run's config names (``model.name``, ``model.flavor``,
    ``model.vocab_size``) that disagree with the checkpoint; ``key`` is the config path of the
    model section (e.g. ``trainer.engine.model``). Unset keys are not compared."""
    from forge.engines.titan.flavors import resolve_model_args

    where = f"{checkpoint.path}/config.json"
    named = model_cfg.model_fields_set
    if "name" in named and model_cfg.name != checkpoint.name:
        raise CheckpointModelError(
            f"{key}.name is {model_cfg.name!r} but {where} declares {checkpoint.architecture} "
            f"({checkpoint.name!r}): remove {key}.name (the checkpoint decides), or point "
            f"{key}.hf_path at a {model_cfg.name} checkpoint"
        )
    if "vocab_size" in named and model_cfg.vocab_size is not None:
        rows = checkpoint.model_args.vocab_size
        if model_cfg.vocab_size != rows:
            raise CheckpointModelError(
                f"{key}.vocab_size is {model_cfg.vocab_size} but {where} has vocab_size {rows} "
                f"(embedding rows): remove {key}.vocab_size, the checkpoint decides it"
            )
    if "flavor" in named and model_cfg.flavor is not None:
        name = model_cfg.name if "name" in named else checkpoint.name
        if name not in ("qwen3", "llama3"):
            raise CheckpointModelError(
                f"{key}.flavor {model_cfg.flavor!r}: there are no named flavors for {name}; "
                f"remove {key}.flavor, the checkpoint decides the model"
            )
        flavor = model_settings(resolve_model_args(name, model_cfg.flavor, checkpoint.model_args.vocab_size))
        differ = settings_differences(flavor, checkpoint.settings)
        if differ:
            raise CheckpointModelError(
                f"{key}.flavor {model_cfg.flavor!r} ({name}) disagrees with {where}: "
                f"{'; '.join(differ)} (flavor vs checkpoint). The checkpoint decides the model: "
                f"remove {key}.flavor, or point {key}.hf_path at the checkpoint you meant"
            )


def settings_differences(first: dict[str, Any], second: dict[str, Any]) -> list[str]:
    """``"<setting> <first> vs <second>"`` for every setting (of ``model_settings``) that differs."""
    return [f"{name} {value!r} vs {second[name]!r}" for name, value in first.items() if second[name] != value]


def check_tokenizer_fits(tokenizer_size: int, checkpoint: CheckpointModel, tokenizer_path: str) -> None:
    """A tokenizer may have fewer tokens than embedding rows (Qwen pads its table), never more."""
    rows = checkpoint.model_args.vocab_size
    if tokenizer_size > rows:
        raise CheckpointModelError(
            f"the tokenizer at {tokenizer_path} has {tokenizer_size} tokens but the model at "
            f"{checkpoint.path} has {rows} embedding rows: ids above {rows - 1} have no embedding. "
            "Use the tokenizer that belongs to the checkpoint"
        )


def check_new_model_rows(rows: int, tokenizer_size: int, model_cfg, key: str, tokenizer_path: str) -> None:
    """A model built from scratch (no checkpoint) needs one embedding row per token. Extra rows
    start random, so the policy samples ids that decode to nothing; a checkpoint's padded rows
    were trained down and are accepted (`check_tokenizer_fits`)."""
    if rows == tokenizer_size:
        return
    named = (
        f"{key}.vocab_size is {rows}"
        if model_cfg.vocab_size is not None
        else f"{key}.flavor {model_cfg.flavor!r} has vocab_size {rows}"
    )
    why = (
        "the extra rows would be random and sample ids that decode to nothing"
        if rows > tokenizer_size
        else f"ids above {rows - 1} would have no embedding"
    )
    raise CheckpointModelError(
        f"{named} but the tokenizer at {tokenizer_path} has {tokenizer_size} tokens, and the model is "
        f"built from scratch (no {key}.hf_path): {why}. Set {key}.vocab_size={tokenizer_size}"
    )


def _architecture(raw: dict[str, Any], path: Path) -> str:
    architectures = raw.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
        found = architectures or f"none (model_type {raw.get('model_type')!r})"
        raise CheckpointModelError(
            f"{path}/config.json: architecture {found} is not supported by the trainer. "
            f"Supported: {_SUPPORTED_TEXT}"
        )
    return architectures[0]


def _refuse_unsupported(config: dict[str, Any], architecture: str, where: str) -> None:
    problems = []
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config['hidden_act']!r} (the trainer's MLP is SiLU-gated)")
    if config.get("use_sliding_window"):
        problems.append("use_sliding_window true (the trainer attends over the whole sequence)")
    if config.get("mlp_bias"):
        problems.append("mlp_bias true (the trainer's MLP has no biases)")
    rope = config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        problems.append(f"rope_scaling type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        problems.append("partial_rotary_factor other than 1.0")
    if problems:
        raise CheckpointModelError(
            f"{where} ({architecture}) has settings the trainer cannot represent: "
            f"{'; '.join(problems)}. Supported: {_SUPPORTED_TEXT} with their standard settings"
        )


def _check_weights_fit(model: CheckpointModel) -> None:
    """The safetensors headers agree with config.json on the embedding rows and on tying."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for file in sorted(model.path.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            shapes.update({name: handle.get_slice(name).get_shape() for name in handle.keys()})
    if not shapes:
        return  # reading the weights reports it, naming the directory
    where = f"{model.path}/config.json"
    embedding = shapes.get("model.embed_tokens.weight")
    rows = model.model_args.vocab_size
    if embedding is not None and embedding[0] != rows:
        raise CheckpointModelError(
            f"{where} says vocab_size {rows} but model.embed_tokens.weight has {embedding[0]} rows: "
            "the checkpoint is inconsistent; fix vocab_size in its config.json"
        )
    if not model.model_args.enable_weight_tying and "lm_head.weight" not in shapes:
        raise CheckpointModelError(
            f"{where} says tie_word_embeddings false but the weights have no lm_head.weight: "
            "set tie_word_embeddings true if the output layer is the embedding"
        )


def parameter_count(settings: dict[str, Any]) -> int:
    """The parameters of a decoder described by `model_settings` (biases left out)."""
    hidden, heads, head_dim = settings["hidden_size"], settings["num_attention_heads"], settings["head_dim"]
    kv_heads, vocab = settings["num_key_value_heads"], settings["vocab_size"]
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    mlp = 3 * hidden * settings["intermediate_size"]
    norms = 2 * hidden + (2 * head_dim if settings["qk_norm"] else 0)
    embeddings = vocab * hidden * (1 if settings["tie_word_embeddings"] else 2)
    return embeddings + settings["num_hidden_layers"] * (attention + mlp + norms) + hidden


def lora_parameter_count(settings: dict[str, Any], targets: list[str], rank: int) -> int:
    """The LoRA adapters' parameters (``rank * (in + out)`` per adapted layer) of a decoder
    described by `model_settings`, its layers named by `targets` (e.g. ``["q_proj", "v_proj"]``)."""
    hidden, inter = settings["hidden_size"], settings["intermediate_size"]
    queries = settings["num_attention_heads"] * settings["head_dim"]
    keys = settings["num_key_value_heads"] * settings["head_dim"]
    shapes = {
        "q_proj": (hidden, queries),
        "k_proj": (hidden, keys),
        "v_proj": (hidden, keys),
        "o_proj": (queries, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    per_block = sum(rank * sum(shapes[name]) for name in targets)
    return settings["num_hidden_layers"] * per_block


def _intermediate_size(args) -> int:
    if hasattr(args, "hidden_dim"):
        return args.hidden_dim
    # torchtitan's llama3 derives its MLP width from dim, multiple_of and ffn_dim_multiplier.
    import torch
    from torchtitan.models.llama3.model.model import FeedForward

    with torch.device("meta"):
        ffn = FeedForward(args.dim, 4 * args.dim, args.multiple_of, args.ffn_dim_multiplier)
    return ffn.w1.out_features


def check_model_section(
    model_cfg, key: str, tokenizer_size: int | None, tokenizer_path: str
) -> CheckpointModel | None:
    """Every start-up check of an engine's ``model`` section (at config path ``key``): a
    checkpoint the trainer can represent, agreeing with the config, with room for every token
    of the tokenizer; without a checkpoint, a known flavor. Returns the checkpoint's model."""
    from forge.engines.titan.flavors import resolve_model_args

    if model_cfg.hf_path is None:
        try:
            args = resolve_model_args(model_cfg.name, model_cfg.flavor, model_cfg.vocab_size)
        except ValueError as error:
            raise CheckpointModelError(f"{key}: {error}") from None
        if tokenizer_size is not None:
            check_new_model_rows(args.vocab_size, tokenizer_size, model_cfg, key, tokenizer_path)
        return None
    path = Path(model_cfg.hf_path)
    if not path.is_dir():
        raise FileNotFoundError(f"{key}.hf_path: checkpoint directory {path} does not exist")
    checkpoint = read_checkpoint_model(path)
    check_config_agrees(model_cfg, checkpoint, key)
    if tokenizer_size is not None:
        check_tokenizer_fits(tokenizer_size, checkpoint, tokenizer_path)
    return checkpoint
