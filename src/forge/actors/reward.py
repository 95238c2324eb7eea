"""RewardActor: scores completions with the reward functions listed in config, and the reward
server of `reward.remote`."""

from __future__ import annotations

from monarch.actor import endpoint
from pydantic import Field

from forge.config import ForgeConfigModel
from forge.controller import ForgeActor
from forge.data.remote_reward import RemoteRewardConfig
from forge.data.reward_scoring import RewardScorer
from forge.data.rewards import RewardFnName


class RewardFnConfig(ForgeConfigModel):
    # A built-in name (forge.data.rewards.REWARD_FUNCTIONS) or "package.module:function"; a
    # function decorated with forge.data.group_rewards.group_reward scores a group per call.
    name: RewardFnName
    weight: float = 1.0


class RewardConfig(ForgeConfigModel):
    functions: list[RewardFnConfig] = [RewardFnConfig(name="toy_task")]
    # What a response scores from a reward function that raises, returns anything but a finite
    # number, ends its process or times out (a group function: every response of the group),
    # and from the reward server when its batch failed for good (the run goes on; each failure
    # is counted in reward/<name>/errors or reward/<name>/timeouts).
    error_reward: float = 0.0
    # Longest a reward function may take on one response (a group function: on its group); the
    # functions then run in processes that are killed when a call hangs
    # (forge.data.reward_scoring). None: in-process, no limit.
    timeout_s: float | None = Field(5.0, gt=0)
    # A reward server that scores batches of responses over HTTP (forge.data.remote_reward),
    # weighed in with the functions as reward/remote.
    remote: RemoteRewardConfig | None = None


class RewardActor(ForgeActor):
    def __init__(self, cfg: RewardConfig):
        self.scorer = RewardScorer(
            [(f.name, f.weight) for f in cfg.functions], cfg.error_reward, cfg.timeout_s, cfg.remote
        )

    @endpoint
    async def evaluate_response(
        self, prompt: str, response: str, target: str
    ) -> tuple[float, dict[str, float]]:
        """(weighted total, {function name: its value}) of one response, a group of its own."""
        return self.scorer.score(prompt, response, target)

    @endpoint
    async def evaluate_groups(
        self, prompts: list[list[str]], responses: list[list[str]], targets: list[str]
    ) -> list[list[tuple[float, dict[str, float]]]]:
        """`evaluate_response` for every response of several groups, in one call, with group
        functions scoring each group as a whole (one prompt per response: after several turns
        each response has its own conversation before it)."""
        return self.scorer.score_groups(prompts, responses, targets)

    @endpoint
    async def counts(self) -> dict[str, int]:
        """Failed reward calls since the start (a function's on a response or a group, a request
        to the reward server): {"errors": n, "timeouts": n}."""
        return self.scorer.counts

    async def __cleanup__(self, exc: Exception | None) -> None:
        """When the actor stops: the reward worker stops now, not when its pipe closes."""
        self.scorer.close()
