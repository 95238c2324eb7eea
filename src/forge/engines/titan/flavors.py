"""Model flavors (sizes): our own registry, searched before torchtitan's built-in ones.

The tiny flavors train in seconds on a CPU: the tests and the embedded demo (a
character-level tokenizer on an arithmetic task) use them. Their vocabulary is a
placeholder: the engine config sets ``model.vocab_size`` from the tokenizer.
"""

import copy
import dataclasses

from torchtitan.models.llama3 import TransformerModelArgs
from torchtitan.models.qwen3 import Qwen3ModelArgs
from torchtitan.protocols.model import BaseModelArgs
from torchtitan.protocols.train_spec import get_train_spec

SUPPORTED_MODELS = ("qwen3", "llama3")

_FLAVORS: dict[str, dict[str, BaseModelArgs]] = {name: {} for name in SUPPORTED_MODELS}


def register_flavor(model_name: str, flavor_name: str, model_args: BaseModelArgs) -> None:
    """Make ``flavor_name`` usable as ``model.flavor`` for ``model_name``.

    ``model_args`` is the train spec's dataclass (``Qwen3ModelArgs`` or ``TransformerModelArgs``);
    the engine works on a copy, so registering never lets one engine change another's sizes.
    """
    if model_name not in SUPPORTED_MODELS:
        raise ValueError(f"unknown model {model_name!r}; supported models: {list(SUPPORTED_MODELS)}")
    if flavor_name in _FLAVORS[model_name]:
        raise ValueError(f"flavor {flavor_name!r} is already registered for {model_name}")
    _FLAVORS[model_name][flavor_name] = copy.deepcopy(model_args)


def known_flavors(model_name: str) -> list[str]:
    """Our flavors first, then torchtitan's."""
    ours = list(_FLAVORS[model_name])
    return ours + [name for name in get_train_spec(model_name).model_args if name not in ours]


def resolve_model_args(model_name: str, flavor: str, vocab_size: int | None = None) -> BaseModelArgs:
    """A private copy of the flavor's model args, with ``vocab_size`` overridden when given."""
    if model_name not in SUPPORTED_MODELS:
        raise ValueError(f"unknown model {model_name!r}; supported models: {list(SUPPORTED_MODELS)}")
    if flavor in _FLAVORS[model_name]:
        args = _FLAVORS[model_name][flavor]
    else:
        builtin = get_train_spec(model_name).model_args
        if flavor not in builtin:
            raise ValueError(
                f"unknown flavor {flavor!r} for model {model_name!r} (model.flavor); "
                f"known flavors: {known_flavors(model_name)}"
            )
        args = builtin[flavor]
    args = copy.deepcopy(args)
    if vocab_size is not None:
        args = dataclasses.replace(args, vocab_size=vocab_size)
    return args


register_flavor(
    "qwen3",
    "tiny",
    Qwen3ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        hidden_dim=128,
        vocab_size=128,
        max_seq_len=512,
        rope_theta=1_000_000,
        qk_norm=True,
        enable_weight_tying=True,
    ),
)
register_flavor(
    "qwen3",
    "small",
    Qwen3ModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        hidden_dim=768,
        vocab_size=128,
        max_seq_len=2048,
        rope_theta=1_000_000,
        qk_norm=True,
        enable_weight_tying=True,
    ),
)
# `tiny` with two heads of 32: vLLM's CPU attention rejects head size 16 (tests of the vLLM engine).
register_flavor(
    "qwen3",
    "tiny_hd32",
    Qwen3ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        head_dim=32,
        hidden_dim=128,
        vocab_size=128,
        max_seq_len=512,
        rope_theta=1_000_000,
        qk_norm=True,
        enable_weight_tying=True,
    ),
)
register_flavor(
    "llama3",
    "tiny",
    TransformerModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=128,
        multiple_of=32,
        max_seq_len=512,
        rope_theta=500_000,
    ),
)
