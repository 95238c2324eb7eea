"""Sequence packing: the sequences of a micro-batch laid end to end in one row, no padding.

RL batches hold responses from a few tokens to the generation limit; padding each micro-batch
to its longest row computes the rest for nothing. A packed micro-batch is one row of the
sequences' tokens, with positions that restart at every sequence (RoPE sees each sequence as
if alone) and attention kept within each sequence (``forge.engines.titan.attention``), so every
token's prediction is the one it would have in a padded row.

Micro-batches are formed by a token budget: sequences are taken in order and a micro-batch is
closed when the next sequence would take it over the budget (a sequence longer than the budget
gets a micro-batch of its own; sequences are never split). The per-token results come back in
the padded layout the losses read, so a loss is computed per sequence exactly as without packing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor
from torchtitan.models.attention import VarlenMetadata

from forge.rl.batch import PolicyBatch


def plan_microbatches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Row indices of each micro-batch, in order; rows of length 0 (nothing to train) are left out."""
    if token_budget <= 0:
        raise ValueError(f"token budget must be > 0, got {token_budget}")
    plan: list[list[int]] = []
    used = token_budget  # forces a new micro-batch for the first row
    for row, length in enumerate(lengths):
        if length == 0:
            continue
        if used + length > token_budget:
            plan.append([])
            used = 0
        plan[-1].append(row)
        used += length
    return plan


@dataclass(frozen=True)
class PackedRow:
    """One micro-batch's sequences in one row of ``num_tokens`` tokens."""

    tokens: Tensor
    """``[1, N]`` the sequences' input tokens, end to end."""
    target_ids: Tensor
    """``[1, N]`` what each position predicts."""
    positions: Tensor
    """``[1, N]`` each token's position within its own sequence."""
    attention: VarlenMetadata
    """Where each sequence starts (``cu_seq_q`` ``[k + 1]``) and the longest one."""
    padded_index: Tensor
    """``[N]`` each packed token's place in the ``[k, width]`` padded layout, flattened."""
    width: int

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]

    def to_padded(self, values: Tensor) -> Tensor:
        """``values`` ``[1, N, ...]`` of the packed tokens as ``[k, width, ...]``, zero where no
        token was packed (differentiable)."""
        rows = self.attention.cu_seq_q.numel() - 1
        flat = values.new_zeros(rows * self.width, *values.shape[2:])
        return flat.index_copy(0, self.padded_index, values[0]).view(rows, self.width, *values.shape[2:])


def pack(tokens: Tensor, target_ids: Tensor, lengths: Tensor) -> PackedRow:
    """Packs the first ``lengths[i]`` tokens of each row of ``tokens`` / ``target_ids`` ``[k, width]``."""
    rows, width = tokens.shape
    if lengths.numel() != rows or int(lengths.min()) < 1 or int(lengths.max()) > width:
        raise ValueError(f"pack: lengths {lengths.tolist()} must be in [1, {width}], one per row of {rows}")
    lengths = lengths.to(tokens.device)
    keep = torch.arange(width, device=tokens.device)[None, :] < lengths[:, None]
    cu_seqlens = torch.zeros(rows + 1, dtype=torch.int32, device=tokens.device)
    cu_seqlens[1:] = lengths.cumsum(0)
    longest = int(lengths.max())
    return PackedRow(
        tokens=tokens[keep][None],
        target_ids=target_ids[keep][None],
        positions=keep.nonzero()[:, 1][None],
        attention=VarlenMetadata(cu_seqlens, cu_seqlens, longest, longest),
        padded_index=keep.flatten().nonzero().squeeze(1),
        width=width,
    )


@dataclass(frozen=True)
class Microbatch:
    rows: Tensor
    """Which rows of the step's batch."""
    batch: PolicyBatch
    """Those rows, on the device, at the batch's full width (a loss may read the width:
    fixed_horizon's default horizon)."""
    packed: PackedRow | None
    """Their tokens packed, or None for padded rows."""


class MicrobatchPlan:
    """How one rank's batch is cut into micro-batches: packed by a token budget (``token_budget``,
    or ``rows_per_microbatch`` times the longest sequence, or all of them), or padded rows of
    ``rows_per_microbatch`` (all rows when None)."""

    def __init__(
        self, batch: PolicyBatch, packing: bool, rows_per_microbatch: int | None, token_budget: int | None
    ) -> None:
        batch.check()
        self.batch = batch
        self.lengths = batch.sequence_lengths()
        self.packing = packing and bool(self.lengths.any())
        if self.packing:
            longest = int(self.lengths.max())
            budget = token_budget or (rows_per_microbatch or batch.num_rows) * longest
            self.rows = [torch.tensor(rows) for rows in plan_microbatches(self.lengths.tolist(), budget)]
        else:
            self.rows = batch.row_groups(rows_per_microbatch)

    def __len__(self) -> int:
        return len(self.rows)

    def on(self, device: torch.device) -> Iterator[Microbatch]:
        """The micro-batches, each moved to ``device`` as it is reached."""
        for rows in self.rows:
            microbatch = self.batch.select(rows).to(device)
            packed = (
                pack(microbatch.tokens, microbatch.scored_target_ids(), self.lengths[rows])
                if self.packing
                else None
            )
            yield Microbatch(rows, microbatch, packed)
