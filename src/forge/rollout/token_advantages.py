"""Per-token advantages of a rollout's episodes, set once every score of their tokens is in
(the reference model's and the teacher's logprobs, the critic's values): REINFORCE++
(``rollout.advantage: reinforce_pp``), PPO's GAE from a critic (``rollout.advantage: gae``) and
on-policy distillation (``distill``). Pure math on the process that holds the episodes: the
app's rollout step (``forge.rollout.step``) and the serial recipe both call it, so both give the
same numbers.

An episode's token advantages are its rewards' (REINFORCE++'s normalised returns, GAE's
advantages normalised likewise, or else its group advantage on every token) plus
``distill_weight * (teacher logprob - generator logprob)`` on the tokens the model sampled; 0 on
the environment's tokens (never trained). With GAE the episode also keeps the critic's values
and GAE's returns, which the critic trains on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from forge.data.types import Episode
from forge.observability import Reduce, record_metric
from forge.rl.advantage import (
    distill_advantages,
    gae,
    reinforce_pp_advantages,
    sequence_token_rewards,
    whiten,
)


@dataclass(frozen=True)
class GAE:
    """GAE's discount and its trace decay (``critic.gamma``, ``critic.lam``)."""

    gamma: float = 1.0
    lam: float = 1.0


@dataclass(frozen=True)
class TokenAdvantages:
    """``reinforce_pp``: REINFORCE++ with its KL penalty ``kl_coef`` (against the episodes'
    ``ref_logprobs``), normalised over the episodes of one ``apply`` (a rollout step's);
    ``gae``: GAE from a critic's values instead, with the same token rewards (KL penalty
    included) and the same normalisation of the advantages; ``distill_weight``: the teacher's
    term (0: no teacher)."""

    reinforce_pp: bool = False
    gae: GAE | None = None
    kl_coef: float = 0.0
    distill_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.reinforce_pp and self.gae is not None:
            raise ValueError("TokenAdvantages: reinforce_pp and gae are two advantages: pick one")

    def apply(
        self,
        episodes: list[Episode],
        teacher_logprobs: list[list[float]] | None = None,
        values: list[list[float]] | None = None,
    ) -> None:
        """Sets ``token_advantages`` of every episode (with ``gae``, also its ``values`` and
        ``returns``). ``teacher_logprobs``: the teacher's logprob of each response token of each
        episode (needed with a ``distill_weight``); ``values``: the critic's value of each (needed
        with ``gae``). Records ``distill/reverse_kl``: each episode's mean of ``generator -
        teacher`` logprob over its sampled tokens, averaged over the episodes; with ``gae``,
        ``critic/explained_variance`` of the returns by the values over the rollout."""
        if not episodes:
            return
        if self.distill_weight and teacher_logprobs is None:
            raise ValueError("TokenAdvantages.apply: distillation needs the teacher's logprobs")
        if self.gae is not None and values is None:
            raise ValueError("TokenAdvantages.apply: GAE needs the critic's values")
        mask = _padded([e.completion.model_mask for e in episodes])
        generator = _padded([e.completion.logprobs for e in episodes])
        if self.reinforce_pp or self.gae is not None:
            rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
            with_kl = self.kl_coef > 0
            if with_kl and any(e.ref_logprobs is None for e in episodes):
                raise ValueError(
                    "TokenAdvantages.apply: the KL penalty needs the reference logprobs (rollout.kl_coef)"
                )
            reference = _padded([e.ref_logprobs for e in episodes]) if with_kl else None
            sampled = generator if with_kl else None
        if self.reinforce_pp:
            advantages = reinforce_pp_advantages(rewards, mask, sampled, reference, self.kl_coef)
        elif self.gae is not None:
            token_rewards = sequence_token_rewards(rewards, mask, sampled, reference, self.kl_coef)
            # The environment's tokens are no states of the policy: their values are never used.
            critic = torch.where(mask != 0, _padded(values), 0.0)
            advantages, returns = gae(token_rewards, critic, mask, self.gae.gamma, self.gae.lam)
            advantages = whiten(advantages, mask)
            _record_explained_variance(critic, returns, mask)
            for episode, value_row, return_row in zip(episodes, critic, returns, strict=True):
                episode.values = value_row[: episode.response_len].tolist()
                episode.returns = return_row[: episode.response_len].tolist()
        else:
            advantages = torch.tensor([e.advantage for e in episodes], dtype=torch.float32)[:, None] * mask
        if self.distill_weight:
            gap = distill_advantages(generator, _padded(teacher_logprobs), mask)
            advantages = advantages + self.distill_weight * gap
            # The sampled tokens' mean of generator - teacher logprob: the gap's, negated.
            counts = mask.sum(-1)
            reverse_kl = -gap.sum(-1) / counts.clamp(min=1)
            for kl, count in zip(reverse_kl.tolist(), counts.tolist(), strict=True):
                if count:
                    record_metric("distill/reverse_kl", kl, Reduce.MEAN)
        for episode, row in zip(episodes, advantages, strict=True):
            episode.token_advantages = row[: episode.response_len].tolist()


def _record_explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> None:
    """``critic/explained_variance``: ``1 - Var(returns - values) / Var(returns)`` over the sampled
    tokens of the rollout (1: the critic predicts the returns; 0: no better than their mean)."""
    sampled = mask != 0
    if sampled.sum() < 2:
        return
    spread = returns[sampled].var(correction=0)
    if spread > 0:
        missed = (returns[sampled] - values[sampled]).var(correction=0)
        record_metric("critic/explained_variance", float(1 - missed / spread), Reduce.MEAN)


def _padded(rows: Sequence[Sequence[float]]) -> Tensor:
    """``[len(rows), longest]`` float32, right-padded with 0 (float32, as the trainer reads them)."""
    out = torch.zeros(len(rows), max(len(r) for r in rows))
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out
