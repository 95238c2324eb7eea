"""Group-relative advantages: each prompt's completions are scored against each other."""

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
