"""``PolicyBatch``: one data-parallel rank's training batch, the record a loss is called with.

It lives in ``forge.rl`` (pure torch) because every loss takes it; ``from_episodes`` reads
``forge.data.types.Episode`` records by attribute only.

For an episode with prompt ids p (length P) and response ids r (length R) the sequence is
s = p + r. The model reads ``tokens = s[:-1]`` and ``logits[:, t]`` predicts
``target_ids[:, t] = s[t + 1]``, so the response tokens are the targets at positions
``P - 1 .. P + R - 2`` (the response span): that is where the generator's (and reference's)
per-token logprobs are placed, and where ``loss_mask`` is 1, except on the tokens of a
multi-turn response that the environment wrote (``Completion.response_mask`` 0), which are
read as context but never trained. Rows are right-padded to the longest one.

The replay buffer builds one batch per data-parallel rank (``PolicyBatch.from_episodes``);
the trainer splits it into microbatches and calls ``loss(logits, microbatch)``. On plain
tensors (a notebook), build one directly: ``PolicyBatch(target_ids=..., loss_mask=...,
advantages=..., generator_logprobs=...)``. It is a dataclass of tensors, so it pickles
across processes as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from forge.data.types import Episode


@dataclass
class PolicyBatch:
    """Tensors ``[B, T]`` unless noted; optional fields are None when a loss does not need them."""

    target_ids: Tensor
    """What ``logits[:, t]`` scores (the caller already shifted)."""
    loss_mask: Tensor
    """Non-zero on the tokens that carry loss (response tokens), zero on prompt and padding."""
    tokens: Tensor | None = None
    """The model's input; a loss never reads it (None is fine on plain tensors)."""
    advantages: Tensor | None = None
    """``[B]`` per sequence or ``[B, T]`` per token."""
    generator_logprobs: Tensor | None = None
    """Logprobs of ``target_ids`` under the distribution the generator sampled them from."""
    ref_logprobs: Tensor | None = None
    """The reference model's logprobs of ``target_ids`` (for a KL term)."""
    policy_versions: Tensor | None = None
    """``[B]`` the policy version that generated each row."""
    values: Tensor | None = None
    """A critic's values of the response tokens when they were scored (PPO's value clipping)."""
    returns: Tensor | None = None
    """The returns the critic is trained towards (GAE's, ``forge.rl.advantage.gae``)."""
    step_tokens: Tensor | None = None
    """0-d int64: the loss tokens of the whole optimizer step (every microbatch of every data-parallel
    rank). The trainer sets it (and ``step_sequences``) so that a loss normalises by the step,
    not by its microbatch; None normalises by this batch alone."""
    step_sequences: Tensor | None = None
    """0-d int64: the step's sequences that have at least one loss token."""

    @classmethod
    def from_episodes(cls, episodes: Sequence[Episode], pad_id: int) -> PolicyBatch:
        """Pads the episodes into one batch; ``ref_logprobs``, ``values`` and ``returns`` only when
        every episode has them; ``advantages`` per token when an episode has them
        (``episode_advantages``)."""
        if not episodes:
            raise ValueError("PolicyBatch.from_episodes needs at least one episode")
        completions = [ep.completion for ep in episodes]
        tokens, target_ids, span = pad_sequences(
            [c.prompt_ids for c in completions], [c.response_ids for c in completions], pad_id
        )
        with_ref = all(ep.ref_logprobs is not None for ep in episodes)
        with_values = all(ep.values is not None and ep.returns is not None for ep in episodes)
        return cls(
            target_ids=target_ids,
            loss_mask=place_responses([c.model_mask for c in completions], span),
            tokens=tokens,
            advantages=episode_advantages(episodes, span),
            generator_logprobs=place_responses([c.logprobs for c in completions], span),
            ref_logprobs=place_responses([ep.ref_logprobs for ep in episodes], span) if with_ref else None,
            policy_versions=torch.tensor([ep.policy_version for ep in episodes], dtype=torch.long),
            values=place_responses([ep.values for ep in episodes], span) if with_values else None,
            returns=place_responses([ep.returns for ep in episodes], span) if with_values else None,
        )

    @property
    def num_rows(self) -> int:
        return self.target_ids.shape[0]

    def _map_rows(self, fn) -> PolicyBatch:
        """A batch whose every per-row field is ``fn(tensor)`` (None stays None; step counts are kept)."""
        return dataclasses.replace(
            self, **{name: None if t is None else fn(t) for name, t in self._per_row_fields().items()}
        )

    def _per_row_fields(self) -> dict[str, Tensor | None]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("step_tokens", "step_sequences")
        }

    def to(self, device: torch.device | str) -> PolicyBatch:
        moved = self._map_rows(lambda t: t.to(device))
        for name in ("step_tokens", "step_sequences"):
            if getattr(moved, name) is not None:
                setattr(moved, name, getattr(moved, name).to(device))
        return moved

    def counts(self) -> tuple[Tensor, Tensor]:
        """This batch's loss tokens, and its sequences with at least one (int64 0-d tensors: an
        integer divisor keeps a float32 loss float32)."""
        tokens = (self.loss_mask != 0).sum(-1)
        return tokens.sum(), (tokens > 0).sum()

    def scored_target_ids(self) -> Tensor:
        """``target_ids`` as a model can score them: where no loss is taken a padded target may
        hold an ignore index such as -100, and any valid id does there."""
        return torch.where(self.loss_mask != 0, self.target_ids, 0).long()

    def sequence_lengths(self) -> Tensor:
        """``[B]`` the tokens of each row a loss depends on: up to its last loss token. What follows
        (padding, or context after the last trained token) cannot change an earlier position's
        prediction under causal attention, so a trainer need not compute it."""
        positions = torch.arange(1, self.loss_mask.shape[1] + 1)
        return torch.where(self.loss_mask != 0, positions, 0).amax(-1)

    def select(self, rows: Tensor) -> PolicyBatch:
        """The batch of ``rows`` (indices); step counts are kept."""
        return self._map_rows(lambda t: t[rows])

    def row_groups(self, microbatch_size: int | None) -> list[Tensor]:
        """Row indices of consecutive microbatches of ``microbatch_size`` rows (None: one of all)."""
        self.check()
        size = microbatch_size or self.num_rows or 1
        if self.num_rows % size:
            raise ValueError(f"batch size {self.num_rows} is not a multiple of microbatch_size {size}")
        # (torch splits an empty range into one empty part.)
        return list(torch.arange(self.num_rows).split(size)) if self.num_rows else []

    def split(self, microbatch_size: int | None) -> list[PolicyBatch]:
        """Microbatches of ``microbatch_size`` rows each (None: the whole batch)."""
        return [self.select(rows) for rows in self.row_groups(microbatch_size)]

    def check(self) -> None:
        """Raises ValueError unless every field has the batch's B rows (and T columns where [B, T])."""
        shape = tuple(self.target_ids.shape)
        for name, value in self._per_row_fields().items():
            if value is None:
                continue
            per_row = name in ("advantages", "policy_versions") and value.dim() == 1
            if (value.shape[0] != shape[0]) if per_row else (tuple(value.shape) != shape):
                want = f"[{shape[0]}]" if per_row else str(list(shape))
                raise ValueError(f"PolicyBatch.{name} has shape {list(value.shape)}, expected {want}")


def episode_advantages(episodes: Sequence[Episode], span: Tensor) -> Tensor:
    """``[B]``, each episode's ``advantage``, when no episode has per-token advantages (GRPO's
    case); else ``[B, T]``, each episode's ``token_advantages`` at its response tokens (an
    episode without them repeats its ``advantage`` over them)."""
    if all(ep.token_advantages is None for ep in episodes):
        return torch.tensor([ep.advantage for ep in episodes], dtype=torch.float32)
    rows = [
        ep.token_advantages if ep.token_advantages is not None else [ep.advantage] * ep.response_len
        for ep in episodes
    ]
    return place_responses(rows, span)


def pad_sequences(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``tokens``, ``target_ids`` (long) and the response span (float32, 1 on every response
    target, whoever wrote it)."""
    width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True)) - 1
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    target_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    span = torch.zeros(len(prompts), width)
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        seq = torch.tensor([*prompt, *response], dtype=torch.long)
        tokens[i, : len(seq) - 1] = seq[:-1]
        target_ids[i, : len(seq) - 1] = seq[1:]
        span[i, len(prompt) - 1 : len(seq) - 1] = 1.0
    return tokens, target_ids, span


def place_responses(rows: Sequence[Sequence[float]], span: Tensor) -> Tensor:
    """Per-response-token values laid out at the positions where ``span`` is set (0 elsewhere)."""
    lengths = [len(row) for row in rows]
    if lengths != (span != 0).sum(-1).tolist():
        raise ValueError(
            f"one value per response token needed: got rows of {lengths} values for responses "
            f"of {(span != 0).sum(-1).tolist()} tokens"
        )
    out = torch.zeros(span.shape)
    out[span != 0] = torch.tensor([v for row in rows for v in row], dtype=out.dtype)
    return out


def response_rows(values: Tensor, span: Tensor) -> list[list[float]]:
    """The inverse of ``place_responses``: each row's values where ``span`` is set."""
    return [row[mask != 0].tolist() for row, mask in zip(values, span, strict=True)]
