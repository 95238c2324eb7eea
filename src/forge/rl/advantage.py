"""Advantages: group-relative (each prompt's completions are scored against each other),
REINFORCE++'s per-token returns normalised over a batch (``reinforce_pp_advantages``), the
per-token signal of on-policy distillation from a teacher (``distill_advantages``), and
generalized advantage estimation over the response tokens from a critic's values (``gae``).

The per-token functions take ``[batch, tokens]`` tensors whose ``mask`` marks the tokens the
policy sampled (1) among padding and tokens it did not write (0: an environment's turn of a
multi-turn trajectory); they return 0 at the masked-out tokens."""

from typing import Literal

import torch
from torch import Tensor

AdvantageMode = Literal["grpo", "dr_grpo", "rloo", "none"]


def _check_rewards(where: str, rewards: Tensor) -> None:
    if rewards.dim() not in (1, 2):
        raise ValueError(f"{where}: rewards must be [G] or [N, G], got {tuple(rewards.shape)}")


def group_advantages(rewards: Tensor, mode: AdvantageMode = "grpo", eps: float = 1e-6) -> Tensor:
    """Advantages for rewards shaped ``[G]`` (one group) or ``[N, G]`` (N groups of G completions).

    - ``grpo`` (Shao et al. 2024): ``(r - mean) / (std + eps)``.
    - ``dr_grpo`` (Liu et al. 2025): ``r - mean``; dividing by the std over-weights groups that are
      almost all right or all wrong.
    - ``rloo`` (Ahmadian et al. 2024): ``r`` minus the mean of the group's other ``G - 1`` rewards,
      i.e. ``G / (G - 1) * (r - mean)``.
    - ``none``: the rewards themselves.

    ``std`` is the population std (divide by G, not G - 1): the advantages normalise the group
    itself rather than estimate a wider population's spread, which gives the group exactly unit
    variance, and a one-completion group gives std 0 instead of the unbiased 0 / 0. A group whose
    rewards are all equal, a group of one (G = 1) included, has no signal: every mode but ``none``
    gives exactly 0 there.
    """
    _check_rewards("group_advantages", rewards)
    rewards = rewards if rewards.is_floating_point() else rewards.to(torch.float32)
    if mode == "none":
        return rewards.clone()
    group_size = rewards.shape[-1]
    # Equal rewards would leave the mean's rounding error (~1e-7 in float32) behind, and dividing
    # that by a std of the same size gives advantages of ~0.1: such groups get exactly 0 instead.
    differs = rewards.amax(-1, keepdim=True) > rewards.amin(-1, keepdim=True)
    centred = torch.where(differs, rewards - rewards.mean(-1, keepdim=True), 0.0)
    if mode == "grpo":
        return centred / (rewards.std(-1, correction=0, keepdim=True) + eps)
    if mode == "dr_grpo":
        return centred
    if mode == "rloo":
        # a group of one has no other rewards; its centred reward is already 0
        return centred * (group_size / max(group_size - 1, 1))
    raise ValueError(f"group_advantages: mode must be one of grpo, dr_grpo, rloo, none, got {mode!r}")


def has_signal(rewards: Tensor) -> bool | Tensor:
    """Whether a group's rewards differ; a group whose rewards are all equal has zero advantages
    and teaches nothing (DAPO's dynamic sampling drops it).

    Returns a bool for ``[G]``, a bool tensor ``[N]`` for ``[N, G]``.
    """
    _check_rewards("has_signal", rewards)
    differs = rewards.amax(-1) > rewards.amin(-1)
    return bool(differs) if rewards.dim() == 1 else differs


def _check_token_shapes(where: str, mask: Tensor, **tensors: Tensor | None) -> None:
    shapes = {name: t.shape for name, t in tensors.items() if t is not None}
    if mask.dim() != 2 or any(shape != mask.shape for shape in shapes.values()):
        listed = ", ".join(f"{name} {tuple(shape)}" for name, shape in shapes.items())
        raise ValueError(f"{where}: mask {tuple(mask.shape)} and {listed} must be [batch, tokens] alike")


def _float_dtype(*tensors: Tensor | None) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def reinforce_pp_advantages(
    rewards: Tensor,
    mask: Tensor,
    logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    eps: float = 1e-6,
) -> Tensor:
    """REINFORCE++ (Hu 2025): per-token advantages ``[B, T]`` of sequences with rewards ``[B]``.

    Each sampled token's reward is ``-kl_coef * (logprobs - ref_logprobs)``, the k1 estimate of
    the KL to a reference policy (with ``logprobs`` those the tokens were sampled with; no
    reference: no penalty), and the last sampled token of a sequence adds the sequence's reward.
    A token's return is the sum of the rewards from it to the end of its sequence (no discount:
    the tokens after it that the policy sampled). The advantages are the returns normalised over
    the whole batch: ``(return - mean) / (std + eps)`` with the mean and the population std over
    every sampled token of every sequence, which replaces GRPO's per-group baseline by one of
    the batch (so it works with one sample per prompt).
    """
    token_rewards = sequence_token_rewards(rewards, mask, logprobs, ref_logprobs, kl_coef)
    returns = token_rewards.flip(-1).cumsum(-1).flip(-1)
    return whiten(returns, mask, eps)


def sequence_token_rewards(
    rewards: Tensor,
    mask: Tensor,
    logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
) -> Tensor:
    """Per-token rewards ``[B, T]`` of sequences with rewards ``[B]``: each sampled token's is
    ``-kl_coef * (logprobs - ref_logprobs)`` (the k1 estimate of the KL to a reference policy; no
    reference: 0), and the last sampled token of a sequence adds the sequence's reward; 0 at the
    masked-out tokens. What REINFORCE++ sums into returns and GAE discounts."""
    _check_token_shapes("sequence_token_rewards", mask, logprobs=logprobs, ref_logprobs=ref_logprobs)
    if rewards.shape != mask.shape[:1]:
        raise ValueError(
            f"sequence_token_rewards: rewards must be [batch] = [{mask.shape[0]}], got {tuple(rewards.shape)}"
        )
    if (ref_logprobs is None) != (logprobs is None):
        raise ValueError("sequence_token_rewards: the KL penalty needs both logprobs and ref_logprobs")
    dtype = _float_dtype(rewards, logprobs, ref_logprobs)
    sampled = mask != 0
    token_rewards = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    if logprobs is not None and kl_coef:
        token_rewards = -kl_coef * (logprobs.to(dtype) - ref_logprobs.to(dtype))
    # The last sampled token of each row: the largest column index where the mask is set.
    columns = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(sampled, columns, -1).amax(-1)
    ends = sampled & (columns == last[:, None])
    return torch.where(sampled, token_rewards + torch.where(ends, rewards.to(dtype)[:, None], 0.0), 0.0)


def whiten(values: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """``(values - mean) / (std + eps)`` with the mean and the population std over the tokens
    where ``mask`` is set, in the whole batch; 0 elsewhere (and everywhere when none is set)."""
    sampled = mask != 0
    if not sampled.any():
        return torch.zeros_like(values)
    mean = values[sampled].mean()
    std = values[sampled].std(correction=0)
    return torch.where(sampled, (values - mean) / (std + eps), 0.0)


def distill_advantages(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """On-policy distillation's per-token advantages ``[B, T]``: ``teacher_logprobs -
    student_logprobs`` on the sampled tokens, each token its own (no discount, no return).

    The tokens were sampled from the student, so the mean of ``student - teacher`` over them
    estimates the reverse KL(student || teacher); a policy gradient with these advantages lowers
    it, pushing up the tokens the teacher likes more than the student does. ``student_logprobs``
    are those the tokens were sampled with.
    """
    _check_token_shapes("distill_advantages", mask, student=student_logprobs, teacher=teacher_logprobs)
    dtype = _float_dtype(student_logprobs, teacher_logprobs)
    gap = teacher_logprobs.to(dtype) - student_logprobs.to(dtype)
    return torch.where(mask != 0, gap, 0.0)


def gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) over each sequence's response
    tokens, all ``[batch, tokens]``: returns ``(advantages, returns)``, with
    ``returns = advantages + values`` on the response tokens and 0 elsewhere.

    ``mask`` marks the response tokens (1) among padding and tokens the model did not write
    (0: an environment's turn of a multi-turn trajectory). The masked-out tokens are skipped, not
    steps of the episode: the delta at a response token bootstraps from the value of the next
    response token of its sequence, and the last one's from 0 (the episode ends there):
    ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``.
    ``gamma`` and ``lam`` are in [0, 1]; ``lam = 1`` gives the discounted return minus the value,
    ``lam = 0`` the one-step TD error. Rewards and values at masked-out tokens are ignored.
    """
    if not (token_rewards.shape == values.shape == mask.shape) or token_rewards.dim() != 2:
        raise ValueError(
            "gae: token_rewards, values and mask must be [batch, tokens] alike, got "
            f"{tuple(token_rewards.shape)}, {tuple(values.shape)} and {tuple(mask.shape)}"
        )
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gae: gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    dtype = torch.promote_types(torch.promote_types(token_rewards.dtype, values.dtype), torch.float32)
    response = mask != 0
    rewards = torch.where(response, token_rewards.to(dtype), 0.0)
    values = torch.where(response, values.to(dtype), 0.0)
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(rewards.shape[0], dtype=dtype, device=rewards.device)
    next_advantage = torch.zeros_like(next_value)
    # Backwards over the columns; a masked-out column leaves the carried values as they are.
    for t in range(rewards.shape[1] - 1, -1, -1):
        here = response[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(here, advantage, 0.0)
        next_value = torch.where(here, values[:, t], next_value)
        next_advantage = torch.where(here, advantage, next_advantage)
    returns = torch.where(response, advantages + values, 0.0)
    return advantages, returns
