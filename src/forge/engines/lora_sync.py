"""Adapter-only weight sync with LoRA: the trainer publishes its adapters, not the merged model.

With ``trainer.engine.lora`` the trainer publishes, for each adapted layer, ``A`` ``[rank, in]``
and ``B`` ``[out, rank]`` under the name of the Hugging Face module they adapt
(``model.layers.0.self_attn.q_proj.lora_A.weight``), in the adapters' own dtype. That is a few
tens of MB where the model is GBs. Generators hold the base model (their checkpoint) and take
each version in one of two ways (``generator.lora_sync``):

- ``merge`` (any engine): the generator keeps the base weights of the adapted layers and, for
  each version, loads ``W = base + alpha/rank * B A`` into the engine's weights, computed by
  ``merge`` below, the function the trainer's merged weights come from, on the same dtypes (the
  base in the dtype the trainer keeps it in, the adapters in theirs), then cast to the engine's
  dtype as the trainer casts what it would publish. Generator and trainer thus agree exactly.
- ``vllm_lora`` (vLLM only): vLLM serves the base model with LoRA enabled, each version is added
  from memory under a new LoRA id, and requests carry it (``forge.engines.vllm``).

B starts at zero, so version 0 (and any version with B = 0) is the base model exactly.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

LoraSyncMode = Literal["merge", "vllm_lora"]

# vLLM's LoRA layers are allocated for one of these ranks (vllm.config.lora.MaxLoRARanks, 0.32).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def merge(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``weight + scaling * lora_b @ lora_a``, computed in float32 and returned in the dtype of the
    weight or the adapters, whichever is wider. The trainer's merged weights
    (``forge.engines.titan.lora.merged_weight``) and a generator's merge on arrival are this."""
    dtype = torch.promote_types(weight.dtype, lora_b.dtype)
    return (weight.float() + scaling * (lora_b.float() @ lora_a.float())).to(dtype)


@dataclass(frozen=True)
class AdapterSync:
    """What a generator needs to know of the trainer's adapters: how to take them (``mode``),
    their shape (``rank``, ``targets``: the adapted layers' names), ``alpha``, and the dtypes the
    trainer holds them (``adapter_dtype``) and its frozen base (``base_dtype``) in."""

    mode: LoraSyncMode
    rank: int
    alpha: float
    targets: tuple[str, ...]
    adapter_dtype: str
    base_dtype: str

    @classmethod
    def of(cls, engine_config, mode: LoraSyncMode) -> AdapterSync:
        """For a trainer with ``engine_config`` (a ``TitanEngineConfig`` with ``lora`` set)."""
        lora, training = engine_config.lora, engine_config.training
        return cls(mode, lora.rank, lora.alpha, tuple(lora.targets()), training.dtype, training.frozen_dtype)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def vllm_max_lora_rank(self) -> int:
        """The smallest rank vLLM allocates its LoRA layers for that holds ``rank``."""
        return next(r for r in VLLM_MAX_LORA_RANKS if r >= self.rank)

    def adapted_weights(self, weight_shapes: dict[str, torch.Size]) -> dict[str, torch.Size]:
        """The Hugging Face weights (name -> shape) the trainer adapts, among a model's: the target
        linear layers of the decoder blocks' attention and MLP (not a mixture's experts, which
        the trainer leaves alone as well)."""
        pattern = re.compile(rf"(.*\.)?layers\.\d+\.(self_attn|mlp)\.({'|'.join(self.targets)})\.weight")
        adapted = {name: shape for name, shape in weight_shapes.items() if pattern.fullmatch(name)}
        if not adapted:
            raise ValueError(
                f"trainer.engine.lora adapts {list(self.targets)}, and the generator's model has none of "
                "these layers: the generator must serve the trainer's model"
            )
        return adapted

    def template(
        self, weight_shapes: dict[str, torch.Size], device: torch.device | str = "cpu"
    ) -> dict[str, torch.Tensor]:
        """Receive buffers for one version: ``A`` and ``B`` of every adapted layer."""
        dtype = getattr(torch, self.adapter_dtype)
        buffers = {}
        for name, (out_features, in_features) in self.adapted_weights(weight_shapes).items():
            module = name.removesuffix(".weight")
            buffers[f"{module}.lora_A.weight"] = torch.empty(
                self.rank, in_features, dtype=dtype, device=device
            )
            buffers[f"{module}.lora_B.weight"] = torch.empty(
                out_features, self.rank, dtype=dtype, device=device
            )
        return buffers

    def peft_config(self) -> dict:
        """The adapters' settings as PEFT's ``adapter_config.json`` holds them (what vLLM reads)."""
        return {
            "peft_type": "LORA",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": list(self.targets),
            "bias": "none",
        }


class MergeOnArrival:
    """``generator.lora_sync=merge``: the base weights of the adapted layers, read once from the
    generator's checkpoint, and the merged weights of each version made from them, a chunk at a
    time.

    The base copy lives in host memory, in the dtype the trainer keeps its frozen base in (the
    checkpoint's values as the trainer loads them; pinned where there is CUDA): the runs that need
    adapter sync are those whose GPU has no room for a second copy of the model's linear layers
    beside the trainer (Qwen3-8B's are 12.9 GiB in bfloat16). For the same reason the merged
    weights are not all made at once: ``chunks`` merges about ``chunk_bytes`` of them on the
    engine's device into one reused buffer, for the engine to load before the next chunk is
    made (Qwen3-8B: 1 GiB on the GPU, not 12.9). Each chunk holds the same weights at every
    version, in the engine's order (which a loader may depend on)."""

    def __init__(
        self,
        sync: AdapterSync,
        base: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        chunk_bytes: int = 1 << 30,
    ) -> None:
        self.sync = sync
        self.base = base
        self.names = _chunked(base, dtype.itemsize, chunk_bytes)
        largest = max(sum(base[name].numel() for name in names) for names in self.names)
        self._buffer = torch.empty(largest, dtype=dtype, device=device)
        self.merge_seconds = 0.0  # the merges' share of the last version's load

    @classmethod
    def from_checkpoint(
        cls,
        sync: AdapterSync,
        model_path: str | Path,
        weight_shapes: dict[str, torch.Size],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        chunk_bytes: int = 1 << 30,
    ) -> MergeOnArrival:
        """Reads the adapted weights of ``weight_shapes`` (the engine's) from the checkpoint at
        ``model_path``; a weight whose shape there is not the engine's is refused here, so that no
        version can fail half loaded."""
        adapted = sync.adapted_weights(weight_shapes)
        read = _read_safetensors(model_path, set(adapted))
        base = {}
        for name, shape in adapted.items():  # the engine's order
            if tuple(read[name].shape) != tuple(shape):
                raise ValueError(
                    f"generator.model_path '{model_path}': {name} is {tuple(read[name].shape)} there and "
                    f"{tuple(shape)} in the generator's model: they must be the same checkpoint"
                )
            base[name] = read.pop(name).to(getattr(torch, sync.base_dtype))
            if torch.cuda.is_available():  # host-to-device copies at full speed
                base[name] = base[name].pin_memory()
        return cls(sync, base, dtype, device, chunk_bytes)

    @torch.no_grad()
    def chunks(self, adapters: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        """The merged weights of ``adapters`` (one version's ``A`` and ``B``) by Hugging Face weight
        name, chunk by chunk: each chunk's tensors live in the one buffer that the next chunk
        overwrites, so load a chunk before asking for the next."""
        self.merge_seconds = 0.0
        device = self._buffer.device
        for names in self.names:
            started = time.perf_counter()
            chunk, offset = {}, 0
            for name in names:
                base = self.base[name]
                out = self._buffer[offset : offset + base.numel()].view(base.shape)
                offset += base.numel()
                module = name.removesuffix(".weight")
                lora_a, lora_b = adapters[f"{module}.lora_A.weight"], adapters[f"{module}.lora_B.weight"]
                base = base.to(device, non_blocking=True)
                out.copy_(merge(base, lora_a.to(device), lora_b.to(device), self.sync.scaling))
                chunk[name] = out
            self.merge_seconds += time.perf_counter() - started
            yield chunk


def _chunked(weights: dict[str, torch.Tensor], element_bytes: int, chunk_bytes: int) -> list[list[str]]:
    """The names of ``weights`` in order, in runs of whole decoder layers of at most
    ``chunk_bytes`` (a larger layer alone). Never part of a layer: an engine may fuse its weights
    (vLLM's ``qkv_proj``, ``gate_up_proj``), and vLLM's CPU reload rebuilds each layer it is
    given from that call's weights alone."""
    layers: dict[str, list[str]] = {}
    for name in weights:
        layers.setdefault(re.sub(r"(layers\.\d+)\..*", r"\1", name), []).append(name)
    chunks: list[list[str]] = []
    size = 0
    for names in layers.values():
        nbytes = sum(weights[name].numel() for name in names) * element_bytes
        if not chunks or size + nbytes > chunk_bytes:
            chunks.append([])
            size = 0
        chunks[-1] += names
        size += nbytes
    return chunks


def _read_safetensors(model_path: str | Path, names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors named ``names`` from the ``*.safetensors`` files of a checkpoint directory."""
    from safetensors import safe_open

    found = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in names.intersection(f.keys()):
                found[name] = f.get_tensor(name)
    if missing := sorted(names - found.keys()):
        raise ValueError(
            f"generator.model_path '{model_path}' lacks the base weights of adapted layers {missing[:3]}"
            f"{' ...' if len(missing) > 3 else ''}: merging the trainer's adapters needs them"
        )
    return found
