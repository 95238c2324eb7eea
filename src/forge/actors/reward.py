"""RewardActor: scores completions with the reward functions listed in config."""

from __future__ import annotations

import logging

from monarch.actor import endpoint
from pydantic import model_validator

from forge.config import ForgeConfigModel
from forge.controller import ForgeActor
from forge.data.rewards import get_reward_fn
from forge.observability import Reduce, record_metric

logger = logging.getLogger(__name__)


class RewardFnConfig(ForgeConfigModel):
    name: str
    weight: float = 1.0

    @model_validator(mode="after")
    def _known(self) -> RewardFnConfig:
        get_reward_fn(self.name)  # fails at start-up with the known names
        return self


class RewardConfig(ForgeConfigModel):
    functions: list[RewardFnConfig] = [RewardFnConfig(name="toy_task")]
    # What an episode scores when a reward function raises (the run goes on).
    error_reward: float = 0.0


class RewardActor(ForgeActor):
    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        self.functions = [(f.name, f.weight, get_reward_fn(f.name)) for f in cfg.functions]

    def _score(self, prompt: str, response: str, target: str) -> tuple[float, dict[str, float]]:
        total, breakdown = 0.0, {}
        for name, weight, fn in self.functions:
            try:
                value = float(fn(prompt, response, target))
            except Exception:
                # A broken reward function must not stop the run, nor pass unnoticed.
                logger.exception("reward function '%s' raised on response %r", name, response[:200])
                record_metric(f"reward/{name}/errors", 1, Reduce.SUM)
                value = self.cfg.error_reward
            breakdown[name] = value
            record_metric(f"reward/{name}", value, Reduce.MEAN)
            total += weight * value
        record_metric("reward/total", total, Reduce.MEAN)
        return total, breakdown

    @endpoint
    async def evaluate_response(
        self, prompt: str, response: str, target: str
    ) -> tuple[float, dict[str, float]]:
        """(weighted total, {function name: its value})."""
        return self._score(prompt, response, target)

    @endpoint
    async def evaluate_group(
        self, prompt: str, responses: list[str], target: str
    ) -> list[tuple[float, dict[str, float]]]:
        """`evaluate_response` for every response of a group, in one call."""
        return [self._score(prompt, r, target) for r in responses]
