"""Reward functions (and a reward server) scored as a run scores them: a `RewardScorer` runs
them, and a `RolloutScorer` over it weighs their values, gives a failed call's responses
error_reward and counts the failure once. For the tests of the functions themselves, which read
(total, {name: value}) per response and the failures counted."""

import asyncio

from forge.data.types import Completion
from forge.rewards.scorer import RewardScorer
from forge.rewards.sources import RewardFunctions, RolloutScorer


def one_turn(prompt: str, response: str) -> Completion:
    ids = list(range(len(response)))
    return Completion(prompt, [0], ids, [0.0] * len(ids), response, "stop", 0)


class Scored:
    def __init__(self, functions: RewardScorer, error_reward: float = 0.0):
        self.functions = functions
        self.scorer = RolloutScorer([RewardFunctions.in_process(functions)], error_reward)

    def score_groups(
        self, prompts: list[list[str]], responses: list[list[str]], targets: list[str]
    ) -> list[list[tuple[float, dict[str, float]]]]:
        groups = [
            [one_turn(p, r) for p, r in zip(group_prompts, group, strict=True)]
            for group_prompts, group in zip(prompts, responses, strict=True)
        ]
        scored = asyncio.run(self.scorer.score(groups, targets))
        return [[(total, breakdown) for total, breakdown, _ in group] for group in scored]

    def score_many(self, items: list[tuple[str, str, str]]) -> list[tuple[float, dict[str, float]]]:
        """Each (prompt, response, target) a group of its own."""
        groups = self.score_groups(
            [[p] for p, _, _ in items], [[r] for _, r, _ in items], [t for *_, t in items]
        )
        return [scored for [scored] in groups]

    @property
    def counts(self) -> dict[str, int]:
        return self.scorer.counts

    def close(self) -> None:
        self.functions.close()
