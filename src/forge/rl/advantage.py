"""Advantages: group-relative (each prompt's completions are scored against each other), and
generalized advantage estimation over the response tokens from a critic's values (``gae``)."""

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
