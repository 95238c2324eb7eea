"""Hugging Face side of the engine: checking state dicts, reading safetensors, writing a model dir.

Parameter names are translated by the train spec's state-dict adapter; this module only
checks, reads and writes.
"""

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torchtitan.protocols.model import BaseModelArgs
from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

logger = logging.getLogger(__name__)

# Buffers some HF checkpoints carry that no model parameter corresponds to.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
_TIED_OUTPUT_KEY = "lm_head.weight"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


def expected_hf_shapes(adapter: BaseStateDictAdapter, titan_shapes: dict[str, torch.Size]) -> dict:
    """HF name -> shape of every tensor the model needs, found by converting meta tensors."""
    meta = {name: torch.empty(shape, device="meta") for name, shape in titan_shapes.items()}
    return {name: tensor.shape for name, tensor in adapter.to_hf(meta).items()}


def check_hf_state_dict(
    state_dict: dict[str, torch.Tensor], expected: dict[str, torch.Size], tied: bool, source: str
) -> dict[str, torch.Tensor]:
    """The tensors of ``state_dict`` the model takes; raises naming ``source`` if any is off."""
    state_dict = {k: v for k, v in state_dict.items() if not k.endswith(_IGNORED_HF_SUFFIXES)}
    if tied:
        # The output layer is the embedding: a separate lm_head copy, if present, is redundant.
        state_dict.pop(_TIED_OUTPUT_KEY, None)
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    wrong_shape = [
        f"{name}: got {tuple(state_dict[name].shape)}, model needs {tuple(shape)}"
        for name, shape in expected.items()
        if name in state_dict and state_dict[name].shape != shape
    ]
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    if wrong_shape:
        problems.append(f"wrong shapes {wrong_shape} (is model.flavor right?)")
    if problems:
        raise ValueError(f"Hugging Face weights from {source} do not fit the model: " + "; ".join(problems))
    return state_dict


def read_safetensors_dir(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in a local HF checkpoint directory."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"Hugging Face checkpoint directory {path} does not exist (model.hf_path)")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in Hugging Face checkpoint directory {path}")
    state_dict = {}
    for file in files:
        state_dict.update(load_file(file))
    return state_dict


def hf_config(
    model_name: str,
    args: BaseModelArgs,
    hf_state_dict: dict[str, torch.Tensor],
    max_position_embeddings: int,
) -> dict:
    """A ``config.json`` for Qwen3ForCausalLM / LlamaForCausalLM matching the model's args.

    Written in the installed transformers' format, plus the pre-5.0 keys (``rope_theta``,
    ``rope_scaling``, ``torch_dtype``) so that older readers (vLLM images) get the same model.
    """
    from transformers import LlamaConfig, Qwen3Config  # only export needs transformers

    dtype = str(hf_state_dict["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    common = {
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": hf_state_dict["model.layers.0.mlp.gate_proj.weight"].shape[0],
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads or args.n_heads,
        "rms_norm_eps": args.norm_eps,
        "attention_bias": False,
        "dtype": dtype,
        # The tokenizer knows the special tokens; transformers' defaults would be wrong ids.
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if model_name == "qwen3":
        if args.moe_enabled or not args.qk_norm:
            raise ValueError(
                "export_hf supports dense qwen3 flavors with qk_norm (Qwen3ForCausalLM), "
                f"got moe_enabled={args.moe_enabled}, qk_norm={args.qk_norm}"
            )
        rope = {"rope_type": "default", "rope_theta": float(args.rope_theta)}
        config = Qwen3Config(
            **common,
            head_dim=args.head_dim,
            max_position_embeddings=max_position_embeddings,
            rope_parameters=rope,
            tie_word_embeddings=args.enable_weight_tying,
            architectures=["Qwen3ForCausalLM"],
        )
    elif model_name == "llama3":
        # torchtitan's llama3 always applies Llama 3.1's frequency scaling to RoPE.
        scaling = args.rope_scaling_args
        rope = {
            "rope_type": "llama3",
            "rope_theta": float(args.rope_theta),
            "factor": scaling.scaling_factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        }
        config = LlamaConfig(
            **common,
            head_dim=args.dim // args.n_heads,
            # The scaled RoPE is meant for original context * factor; transformers warns if the
            # declared context does not exceed the original one.
            max_position_embeddings=max(
                max_position_embeddings,
                int(scaling.original_max_position_embeddings * scaling.scaling_factor),
            ),
            rope_parameters=rope,
            tie_word_embeddings=False,
            mlp_bias=False,
            architectures=["LlamaForCausalLM"],
        )
    else:
        raise ValueError(f"export_hf does not know model {model_name!r}")
    config_dict = config.to_dict()
    config_dict["rope_theta"] = rope["rope_theta"]
    config_dict["torch_dtype"] = dtype
    if rope["rope_type"] != "default":
        config_dict["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return config_dict


def checkpoint_export_config(source_dir: str | os.PathLike, dtype: str) -> dict:
    """The input checkpoint's config.json, with only its dtype changed when the export's differs."""
    config = json.loads((Path(source_dir) / "config.json").read_text())
    declared = [key for key in ("torch_dtype", "dtype") if key in config]
    for key in declared or ["torch_dtype"]:
        config[key] = dtype
    return config


def _is_weights_file(name: str) -> bool:
    # Weights are written anew; pickled formats are never read, so never carried along either.
    return name.endswith((".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth", ".ckpt"))


def write_hf_dir(
    out_dir: str | os.PathLike,
    hf_state_dict: dict[str, torch.Tensor],
    config: dict,
    tokenizer_dir: str | os.PathLike | None = None,
    source_dir: str | os.PathLike | None = None,
) -> Path:
    """Write ``model.safetensors`` + ``config.json`` (+ tokenizer files) so that ``out_dir`` appears
    only complete: everything goes to a temporary sibling that is renamed at the end.

    With ``source_dir`` (the checkpoint training started from) every file of it but the weights
    is carried over unchanged (generation config, tokenizer, chat template, ...), and ``config``
    replaces its config.json. Without it, ``tokenizer_dir``'s tokenizer files are copied and a
    generation config with the tokenizer's special ids is written.
    """
    with written_whole(out_dir) as tmp_dir:
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in hf_state_dict.items()}
        save_file(tensors, tmp_dir / "model.safetensors", metadata={"format": "pt"})
        if source_dir is not None:
            for file in Path(source_dir).iterdir():
                if file.is_file() and not _is_weights_file(file.name):
                    shutil.copy2(file, tmp_dir / file.name)
            if tokenizer_dir is not None and Path(tokenizer_dir).resolve() != Path(source_dir).resolve():
                _copy_tokenizer_files(Path(tokenizer_dir), tmp_dir)
        elif tokenizer_dir is not None:
            _copy_tokenizer_files(Path(tokenizer_dir), tmp_dir)
            # So that plain `transformers` generation stops at the tokenizer's eos.
            config = {**config, **_special_token_ids(tmp_dir)}
            generation = {k: v for k, v in config.items() if k.endswith("_token_id") and v is not None}
            (tmp_dir / "generation_config.json").write_text(
                json.dumps(generation, indent=2, sort_keys=True) + "\n"
            )
        (tmp_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    logger.info("exported a Hugging Face model to %s", out_dir)
    return Path(out_dir)


@contextlib.contextmanager
def written_whole(out_dir: str | os.PathLike) -> Iterator[Path]:
    """A temporary sibling of ``out_dir`` to write into, renamed to ``out_dir`` (replacing it)
    when the block ends without an error: ``out_dir`` is never half-written."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir()
    yield tmp_dir
    if out_dir.exists():
        # Swap in two renames: out_dir is briefly absent, never half-written.
        old_dir = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        out_dir.rename(old_dir)
        tmp_dir.rename(out_dir)
        shutil.rmtree(old_dir)
    else:
        tmp_dir.rename(out_dir)


def _special_token_ids(tokenizer_dir: Path) -> dict[str, int | None]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def _copy_tokenizer_files(tokenizer_dir: Path, dest: Path) -> None:
    present = [name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()]
    if not present:
        raise FileNotFoundError(
            f"no tokenizer files {list(TOKENIZER_FILES)} in tokenizer_dir {tokenizer_dir}"
        )
    for name in present:
        shutil.copy2(tokenizer_dir / name, dest / name)
