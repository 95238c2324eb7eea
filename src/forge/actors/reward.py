"""RewardActor: scores completions with the reward functions listed in config."""

from __future__ import annotations

from monarch.actor import endpoint
from pydantic import Field

from forge.config import ForgeConfigModel
from forge.controller import ForgeActor
from forge.data.reward_scoring import RewardScorer
from forge.data.rewards import RewardFnName


class RewardFnConfig(ForgeConfigModel):
    # A built-in name (forge.data.rewards.REWARD_FUNCTIONS) or "package.module:function".
    name: RewardFnName
    weight: float = 1.0


class RewardConfig(ForgeConfigModel):
    functions: list[RewardFnConfig] = [RewardFnConfig(name="toy_task")]
    # What a response scores from a reward function that raises, returns anything but a finite
    # number, ends its process or times out (the run goes on; each is counted in
    # reward/<name>/errors or reward/<name>/timeouts).
    error_reward: float = 0.0
    # Longest a reward function may take on one response; the functions then run in processes
    # that are killed when a call hangs (forge.data.reward_scoring). None: in-process, no limit.
    timeout_s: float | None = Field(5.0, gt=0)


class RewardActor(ForgeActor):
    def __init__(self, cfg: RewardConfig):
        self.scorer = RewardScorer(
            [(f.name, f.weight) for f in cfg.functions], cfg.error_reward, cfg.timeout_s
        )

    @endpoint
    async def evaluate_response(
        self, prompt: str, response: str, target: str
    ) -> tuple[float, dict[str, float]]:
        """(weighted total, {function name: its value})."""
        return self.scorer.score(prompt, response, target)

    @endpoint
    async def evaluate_groups(
        self, prompts: list[list[str]], responses: list[list[str]], targets: list[str]
    ) -> list[list[tuple[float, dict[str, float]]]]:
        """`evaluate_response` for every response of several groups, in one call (one prompt
        per response: after several turns each response has its own conversation before it)."""
        items = [
            (p, r, t)
            for group_prompts, group, t in zip(prompts, responses, targets, strict=True)
            for p, r in zip(group_prompts, group, strict=True)
        ]
        scores = iter(self.scorer.score_many(items))
        return [[next(scores) for _ in group] for group in responses]

    @endpoint
    async def counts(self) -> dict[str, int]:
        """Responses that scored `error_reward` since the start: {"errors": n, "timeouts": n}."""
        return dict(self.scorer.counts)

    async def __cleanup__(self, exc: Exception | None) -> None:
        """When the actor stops: the reward worker stops now, not when its pipe closes."""
        self.scorer.close()
