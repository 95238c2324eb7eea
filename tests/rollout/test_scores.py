"""A rollout's rewards summed from every source, in one process: the reward functions (a
`RewardScorer` here) and the environment's step rewards; `reward/total` covers them all."""

import asyncio

from forge.data.types import Completion, Turn
from forge.observability.collector import pop_state
from forge.rewards.scorer import RewardScorer
from forge.rollout.scores import score_trajectories


def _raises_on_odd(prompt: str, response: str, target: str) -> float:
    if int(target) % 2:
        raise RuntimeError("odd targets break this reward")
    return 1.0


def completion(response: str, turns: list[Turn] | None = None) -> Completion:
    ids = list(range(len(response)))
    return Completion("1+1=", [0], ids, [0.0] * len(ids), response, "stop", 0, turns=turns)


def test_the_total_covers_the_functions_and_the_environment():
    scorer = RewardScorer([("toy_task", 1.0), (f"{__name__}:_raises_on_odd", 0.5)], error_reward=-1.0)

    async def score_functions(prompts, responses, targets):
        return scorer.score_groups(prompts, responses, targets)

    one_turn = completion("3")
    rewarded = completion("2", [Turn("assistant", "2", 1, reward=0.25)])
    pop_state()
    [[odd], [even]] = asyncio.run(
        score_trajectories([[one_turn], [rewarded]], ["3", "2"], score_functions, env_reward=True)
    )
    state = pop_state()
    assert odd == (1.0 - 0.5, {"toy_task": 1.0, f"{__name__}:_raises_on_odd": -1.0, "env": 0.0}, {})
    assert even == (
        1.0 + 0.5 + 0.25,
        {"toy_task": 1.0, f"{__name__}:_raises_on_odd": 1.0, "env": 0.25},
        {},
    )
    assert state["reward/total"].value() == (odd[0] + even[0]) / 2


def test_single_turn_rollouts_have_no_environment_source():
    """Without an environment (the built-in one-turn one) the breakdown has no ``env`` key."""
    scorer = RewardScorer([("toy_task", 1.0)])

    async def score_functions(prompts, responses, targets):
        return scorer.score_groups(prompts, responses, targets)

    [[scored]] = asyncio.run(score_trajectories([[completion("3")]], ["3"], score_functions))
    assert scored == (1.0, {"toy_task": 1.0}, {})
