"""RewardActor: scores completions with the reward functions listed in config."""

from __future__ import annotations

from monarch.actor import endpoint

from forge.config import ForgeConfigModel
from forge.controller import ForgeActor
from forge.data.rewards import RewardFnName, RewardScorer


class RewardFnConfig(ForgeConfigModel):
    # A built-in name (forge.data.rewards.REWARD_FUNCTIONS) or "package.module:function".
    name: RewardFnName
    weight: float = 1.0


class RewardConfig(ForgeConfigModel):
    functions: list[RewardFnConfig] = [RewardFnConfig(name="toy_task")]
    # What a response scores from a reward function that raises (the run goes on).
    error_reward: float = 0.0


class RewardActor(ForgeActor):
    def __init__(self, cfg: RewardConfig):
        self.scorer = RewardScorer([(f.name, f.weight) for f in cfg.functions], cfg.error_reward)

    @endpoint
    async def evaluate_response(
        self, prompt: str, response: str, target: str
    ) -> tuple[float, dict[str, float]]:
        """(weighted total, {function name: its value})."""
        return self.scorer.score(prompt, response, target)

    @endpoint
    async def evaluate_groups(
        self, prompts: list[str], responses: list[list[str]], targets: list[str]
    ) -> list[list[tuple[float, dict[str, float]]]]:
        """`evaluate_response` for every response of several groups, in one call."""
        return [
            [self.scorer.score(p, r, t) for r in group]
            for p, group, t in zip(prompts, responses, targets, strict=True)
        ]
