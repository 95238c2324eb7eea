"""Per-token advantages of a rollout's episodes, set once every score of their tokens is in
(the reference model's and the teacher's logprobs): REINFORCE++ (``rollout.advantage:
reinforce_pp``) and on-policy distillation (``distill``). Pure math on the process that holds
the episodes: the app's rollout step (``forge.rollout.step``) and the serial recipe both call it,
so both give the same numbers.

An episode's token advantages are its rewards' (REINFORCE++'s normalised returns, or else its
group advantage on every token) plus ``distill_weight * (teacher logprob - generator logprob)``
on the tokens the model sampled; 0 on the environment's tokens (never trained).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from forge.data.types import Episode
from forge.observability import Reduce, record_metric
from forge.rl.advantage import distill_advantages, reinforce_pp_advantages


@dataclass(frozen=True)
class TokenAdvantages:
    """``reinforce_pp``: REINFORCE++ with its KL penalty ``kl_coef`` (against the episodes'
    ``ref_logprobs``), normalised over the episodes of one ``apply`` (a rollout step's);
    ``distill_weight``: the teacher's term (0: no teacher)."""

    reinforce_pp: bool = False
    kl_coef: float = 0.0
    distill_weight: float = 0.0

    def apply(self, episodes: list[Episode], teacher_logprobs: list[list[float]] | None = None) -> None:
        """Sets ``token_advantages`` of every episode. ``teacher_logprobs``: the teacher's logprob
        of each response token of each episode (needed with a ``distill_weight``). Records
        ``distill/reverse_kl``: each episode's mean of ``generator - teacher`` logprob over its
        sampled tokens, averaged over the episodes."""
        if not episodes:
            return
        if self.distill_weight and teacher_logprobs is None:
            raise ValueError("TokenAdvantages.apply: distillation needs the teacher's logprobs")
        mask = _padded([e.completion.model_mask for e in episodes])
        generator = _padded([e.completion.logprobs for e in episodes])
        if self.reinforce_pp:
            rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
            with_kl = self.kl_coef > 0
            if with_kl and any(e.ref_logprobs is None for e in episodes):
                raise ValueError(
                    "TokenAdvantages.apply: REINFORCE++'s KL penalty needs the reference logprobs"
                )
            reference = _padded([e.ref_logprobs for e in episodes]) if with_kl else None
            advantages = reinforce_pp_advantages(
                rewards, mask, generator if with_kl else None, reference, self.kl_coef
            )
        else:
            advantages = torch.tensor([e.advantage for e in episodes], dtype=torch.float32)[:, None] * mask
        if self.distill_weight:
            teacher = _padded(teacher_logprobs)
            advantages = advantages + self.distill_weight * distill_advantages(generator, teacher, mask)
            sampled = mask.sum(-1)
            reverse_kl = ((generator - teacher) * mask).sum(-1) / sampled.clamp(min=1)
            for kl, count in zip(reverse_kl.tolist(), sampled.tolist(), strict=True):
                if count:
                    record_metric("distill/reverse_kl", kl, Reduce.MEAN)
        for episode, row in zip(episodes, advantages, strict=True):
            episode.token_advantages = row[: episode.response_len].tolist()


def _padded(rows: Sequence[Sequence[float]]) -> Tensor:
    """``[len(rows), longest]`` float32, right-padded with 0 (float32, as the trainer reads them)."""
    out = torch.zeros(len(rows), max(len(r) for r in rows))
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out
