"""Exact integer fingerprints of tensors' bytes, equal wherever the same bytes are summed.

Each byte is weighted by its position (mod a prime), so swapped or shifted bytes change the
sum; integer sums do not depend on the reduction order, so a GPU and a CPU agree exactly.
"""

from __future__ import annotations

import torch

_PRIME = 65521


def fingerprint(tensor: torch.Tensor, chunk: int = 1 << 24, first_byte: int = 0) -> torch.Tensor:
    """`tensor`'s fingerprint as a 0-dim int64 tensor on its device, without waiting for it.
    Chunked to bound the temporary memory (three int64 copies of `chunk` bytes); exact below
    about 500 GB per tensor (int64). `first_byte`: where `tensor`'s bytes start in a whole
    tensor it is a piece of (the pieces' fingerprints then sum to the whole's)."""
    data = tensor.detach().contiguous().view(-1).view(torch.uint8)
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, data.numel(), chunk):
        words = data[start : start + chunk].to(torch.int64)
        first = first_byte + start
        positions = torch.arange(first, first + words.numel(), device=words.device) % _PRIME + 1
        total += (words * positions).sum()
    return total


def checksum(
    tensors: dict[str, torch.Tensor], chunk: int = 1 << 24, first_rows: dict[str, int] | None = None
) -> int:
    """One fingerprint of a whole state dict (the sum of its tensors', in Python: no overflow).
    With `first_rows`, each tensor is the piece of a whole one that starts at that row: the
    pieces' checksums then sum to the whole state dict's."""

    def first_byte(name: str) -> int:
        tensor = tensors[name]
        if not first_rows or tensor.dim() == 0 or tensor.shape[0] == 0:
            return 0
        return first_rows[name] * (tensor.numel() // tensor.shape[0]) * tensor.element_size()

    return sum(int(fingerprint(tensors[name], chunk, first_byte(name)).item()) for name in sorted(tensors))
