"""Exact integer fingerprints of tensors' bytes, equal wherever the same bytes are summed.

Each byte is weighted by its position (mod a prime), so swapped or shifted bytes change the
sum; integer sums do not depend on the reduction order, so a GPU and a CPU agree exactly.
"""

from __future__ import annotations

import torch

_PRIME = 65521


def fingerprint(tensor: torch.Tensor, chunk: int = 1 << 24) -> torch.Tensor:
    """`tensor`'s fingerprint as a 0-dim int64 tensor on its device, without waiting for it.
    Chunked to bound the temporary memory (three int64 copies of `chunk` bytes); exact below
    about 500 GB per tensor (int64)."""
    data = tensor.detach().contiguous().view(-1).view(torch.uint8)
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, data.numel(), chunk):
        words = data[start : start + chunk].to(torch.int64)
        positions = torch.arange(start, start + words.numel(), device=words.device) % _PRIME + 1
        total += (words * positions).sum()
    return total


def checksum(tensors: dict[str, torch.Tensor], chunk: int = 1 << 24) -> int:
    """One fingerprint of a whole state dict (the sum of its tensors', in Python: no overflow)."""
    return sum(int(fingerprint(tensors[name], chunk).item()) for name in sorted(tensors))
