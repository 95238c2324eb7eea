"""Each rank's own rows of the model's weights under Hugging Face names: what a sharded (FSDP)
trainer publishes without gathering (forge.weight_sync, `WeightPublisher.stage_rows`).

FSDP shards every parameter by rows (dim 0), so rank r holds rows [first, first + n) of each
tensor; the generator copies each rank's piece into those rows. This needs the state dict
adapter to rename tensors only (Qwen3 and forge's decoder do): one that reshapes or permutes
(torchtitan's Llama 3 permutes q/k) needs whole tensors, and so does tensor parallelism (its
pieces are columns too). Those publish whole: `row_shards` returns None.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


@dataclass
class RowShards:
    """This rank's piece of each tensor, and the row where each piece starts."""

    tensors: dict[str, torch.Tensor]
    first_rows: dict[str, int]


def hf_names(adapter, titan_names: list[str]) -> dict[str, str] | None:
    """titan name -> HF name when `adapter.to_hf` only renames (it hands back the very tensors
    it was given), else None."""
    given = {name: torch.empty(0) for name in titan_names}
    converted = adapter.to_hf(dict(given))
    by_identity = {id(tensor): name for name, tensor in given.items()}
    names = {}
    for hf_name, tensor in converted.items():
        titan_name = by_identity.get(id(tensor))
        if titan_name is None or titan_name in names:
            return None
        names[titan_name] = hf_name
    return names


def row_shards(
    named_tensors: Iterable[tuple[str, torch.Tensor]], names: dict[str, str], dtype: torch.dtype | None
) -> RowShards | None:
    """This rank's rows of each tensor (titan names, as the model's `state_dict()` gives them)
    under their HF names (`names`), cast to `dtype`: one tensor at a time, so a caller may
    compute each as it is read. A tensor that every rank holds whole is the first rank's alone.
    None unless every tensor is whole or sharded by rows over one mesh dimension."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    tensors, first_rows = {}, {}
    for titan_name, value in named_tensors:
        hf_name = names.get(titan_name)
        if hf_name is None:  # not exported (as `to_hf` leaves it out)
            continue
        value = value.detach()
        if isinstance(value, DTensor):
            placements = value.placements
            if all(p.is_replicate() for p in placements):
                local, first = value.to_local(), 0
                whole = True
            elif len(placements) == 1 and placements[0].is_shard(0):
                shape, offset = compute_local_shape_and_global_offset(
                    value.shape, value.device_mesh, placements
                )
                local, first, whole = value.to_local(), offset[0], False
                if tuple(local.shape) != tuple(shape):
                    return None
            else:
                return None
        else:
            local, first, whole = value, 0, True
        if whole and rank != 0:
            continue
        tensors[hf_name] = local if dtype is None else local.to(dtype)
        first_rows[hf_name] = first
    return RowShards(tensors, first_rows)


def gather_to_first_rank(obj: object) -> list[object] | None:
    """Every rank's `obj`, in rank order, on the first rank (None elsewhere): a collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered
