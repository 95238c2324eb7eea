"""ComputeAdvantages: group-relative advantages of a group's rewards."""

from __future__ import annotations

import torch
from monarch.actor import endpoint

from forge.controller import ForgeActor
from forge.observability import Reduce, record_metric
from forge.rl.advantage import group_advantages, has_signal


class ComputeAdvantages(ForgeActor):
    def __init__(self, mode: str = "grpo"):
        self.mode = mode

    def _one(self, rewards: list[float]) -> list[float]:
        tensor = torch.tensor(rewards, dtype=torch.float32)
        record_metric("advantage/groups_without_signal", 0 if has_signal(tensor) else 1, Reduce.SUM)
        return group_advantages(tensor, mode=self.mode).tolist()

    @endpoint
    async def compute_groups(self, rewards: list[list[float]]) -> list[list[float]]:
        """The advantages of several groups' rewards (of any sizes), one list per group."""
        return [self._one(group) for group in rewards]
