"""LoRA (Hu et al., 2021): the trainer's model frozen, with trained low-rank updates of its linear layers.

An adapted layer computes ``W x + b + scaling * B A dropout(x)``: ``W`` and ``b`` frozen, ``A``
``[rank, in]`` and ``B`` ``[out, rank]`` trained, ``scaling = alpha / rank``. ``B`` starts at zero,
so the adapted model starts as its base model, exactly.

The engine adds the adapters on the meta device, before parallelizing (FSDP shards them with
their layers), and freezes every other parameter. An adapted layer keeps its weight and bias
under their own names, so the model's state dict is the base model's plus ``lora_A`` and
``lora_B`` entries. Whatever reads the weights by name (the Hugging Face export, checksums) is
given the merged weights ``W + scaling * B A`` under the base names (``LoraAdapters.merged``);
weight publishing sends the adapters alone (``forge.engines.lora_sync``), and so does a run
checkpoint (``AdapterWeights``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

from forge.engines.lora_sync import merge
from forge.engines.titan.config import LORA_LAYER_NAMES, LoraConfig

_ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


class LoraLinear(nn.Linear):
    """A linear layer with a low-rank update; ``adapting = False`` makes it the plain layer exactly."""

    @classmethod
    def replacing(cls, linear: nn.Linear, config: LoraConfig) -> LoraLinear:
        """A meta-device layer that holds ``linear``'s own weight and bias, plus adapters."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            config,
            bias=linear.bias is not None,
            device="meta",
            dtype=linear.weight.dtype,
        )
        layer.weight = linear.weight
        if linear.bias is not None:
            layer.bias = linear.bias
        return layer

    def __init__(
        self,
        in_features: int,
        out_features: int,
        config: LoraConfig,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.lora_A = nn.Parameter(torch.empty(config.rank, in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(out_features, config.rank, device=device, dtype=dtype))
        self.scaling = config.alpha / config.rank
        self.dropout = config.dropout
        self.adapting = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if not self.adapting:
            return out
        # Dropout in training passes only. The engine keeps its model in train mode and scores
        # without autograd, so scoring is deterministic.
        if self.dropout and self.training and torch.is_grad_enabled():
            x = F.dropout(x, self.dropout)
        return out + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling


def is_adapter(name: str) -> bool:
    """Whether a state-dict entry is an adapter (``lora_A`` or ``lora_B``) rather than a base weight."""
    return name.endswith(_ADAPTER_SUFFIXES)


class LoraAdapters:
    """The adapted layers of one model, by their module names (torchtitan's and Hugging Face's)."""

    def __init__(self, config: LoraConfig, layers: dict[str, LoraLinear], hf_modules: dict[str, str]) -> None:
        self.config = config
        self.layers = layers
        self.hf_modules = hf_modules
        self.scaling = config.alpha / config.rank
        self.adapting = True

    @classmethod
    def add_to(
        cls,
        model: nn.Module,
        state_dict_adapter: BaseStateDictAdapter,
        config: LoraConfig,
        frozen_dtype: torch.dtype | None = None,
    ) -> LoraAdapters:
        """Swaps ``LoraLinear`` layers into ``model`` (on the meta device) where the Hugging Face
        name matches ``config.target_modules``, and freezes every other parameter, cast to
        ``frozen_dtype`` if given (a frozen weight needs no float32 master copy)."""
        targets = set(config.targets())
        layers, hf_modules = {}, {}
        hf_linear = _hf_linear_modules(model, state_dict_adapter)
        for name, hf_module in hf_linear.items():
            if hf_module.rsplit(".", 1)[-1] not in targets:
                continue
            parent_name, _, attribute = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            layers[name] = LoraLinear.replacing(getattr(parent, attribute), config)
            setattr(parent, attribute, layers[name])
            hf_modules[name] = hf_module
        if not layers:  # e.g. only MLP layers named, in a mixture-of-experts model (it has none)
            present = sorted({module.rsplit(".", 1)[-1] for module in hf_linear.values()})
            raise ValueError(
                f"lora.target_modules {config.target_modules!r} matches no linear layer of this model "
                f"(its layers: {', '.join(present)})"
            )
        adapter_params = {id(p) for layer in layers.values() for p in (layer.lora_A, layer.lora_B)}
        for param in model.parameters():
            if id(param) not in adapter_params:
                param.requires_grad_(False)
                if frozen_dtype is not None:  # in place: a tied weight stays one parameter
                    param.data = param.data.to(frozen_dtype)
        return cls(config, layers, hf_modules)

    def initial(self, seed: int) -> dict[str, torch.Tensor]:
        """Fresh adapters as full tensors: ``A`` as PEFT initialises it (kaiming-uniform with
        a=sqrt(5), i.e. uniform in +-1/sqrt(in)), ``B`` zero. Drawn on the CPU from ``seed`` alone,
        so that every rank, and any parallelism, starts from the same adapters."""
        generator = torch.Generator().manual_seed(seed)
        state = {}
        for name, layer in self.layers.items():
            a = torch.empty(self.config.rank, layer.in_features)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            state[f"{name}.lora_A"] = a
            state[f"{name}.lora_B"] = torch.zeros(layer.out_features, self.config.rank)
        return state

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """While active the model is its base model: every adapted layer computes ``W x + b``,
        and ``merged`` gives the base weights."""
        self._set_adapting(False)
        try:
            yield
        finally:
            self._set_adapting(True)

    def _set_adapting(self, adapting: bool) -> None:
        self.adapting = adapting
        for layer in self.layers.values():
            layer.adapting = adapting

    def merged(self, state_dict: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights the model computes with, under the base model's names, from its state dict
        (sharded or not): ``W + scaling * B A`` for each adapted layer (``W`` alone while
        ``disabled``), the rest as they are. One merged weight at a time, so that a caller that
        casts or gathers each holds one extra float32 weight at most. Every rank calls it (a
        merge gathers ``A``)."""
        for name, tensor in state_dict.items():
            if is_adapter(name):
                continue
            module = name.removesuffix(".weight")
            if module in self.layers and self.adapting:
                tensor = merged_weight(
                    tensor, state_dict[f"{module}.lora_A"], state_dict[f"{module}.lora_B"], self.scaling
                )
            yield name, tensor

    def names(self) -> list[str]:
        """The adapters' state-dict names."""
        return [f"{name}{suffix}" for name in self.layers for suffix in _ADAPTER_SUFFIXES]


def merged_weight(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``weight + scaling * lora_b @ lora_a`` (``forge.engines.lora_sync.merge``, which a generator
    merging the published adapters on arrival computes too). FSDP shards ``weight`` and ``lora_b``
    alike, by their common rows: each rank merges its own rows, with the whole of ``lora_a``
    (``rank`` rows)."""
    rows = merge(_local(weight), _whole(lora_a), _local(lora_b), scaling)
    if isinstance(weight, DTensor):
        return DTensor.from_local(
            rows, weight.device_mesh, weight.placements, shape=weight.shape, stride=weight.stride()
        )
    return rows


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _hf_linear_modules(model: nn.Module, state_dict_adapter: BaseStateDictAdapter) -> dict[str, str]:
    """torchtitan module name -> Hugging Face module name of each linear layer of the decoder
    blocks that LoRA may adapt (``LORA_LAYER_NAMES``; not a mixture of experts' router), as the
    train spec's state-dict adapter names their weights."""
    names = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.startswith("layers."):
            weight = torch.empty(module.weight.shape, device="meta")
            for hf_weight in state_dict_adapter.to_hf({f"{name}.weight": weight}):
                hf_module = hf_weight.removesuffix(".weight")
                if hf_module.rsplit(".", 1)[-1] in LORA_LAYER_NAMES:
                    names[name] = hf_module
    return names


class AdapterWeights(Stateful):
    """The model's adapters alone, for a run checkpoint: the frozen base comes from where the run
    starts (the policy checkpoint, or the flavor's seeded initialisation)."""

    def __init__(self, model: nn.Module, names: Iterable[str]) -> None:
        self.model = model
        self.names = set(names)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t for name, t in get_model_state_dict(self.model).items() if name in self.names}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(strict=False))
