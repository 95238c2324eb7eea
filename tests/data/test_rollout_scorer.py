"""A rollout's rewards summed from every source, in one process (`RolloutScorer`): the reward
functions (a `RewardScorer` here), a reward model, the environment's step rewards and an agent's
own reward; `reward/total` covers them all, and a failed call scores error_reward, counted once."""

import asyncio

import pytest

from forge.actors.reward import RewardConfig
from forge.data.types import Completion, Turn
from forge.observability.collector import pop_state
from forge.rewards.scorer import RewardScorer
from forge.rewards.sources import AgentReward, EnvironmentReward, RewardFunctions, RewardModel, RolloutScorer


def _raises_on_odd(prompt: str, response: str, target: str) -> float:
    if int(target) % 2:
        raise RuntimeError("odd targets break this reward")
    return 1.0


def completion(
    response: str, turns: list[Turn] | None = None, agent_reward: float | None = None
) -> Completion:
    ids = list(range(len(response)))
    return Completion(
        "1+1=", [0], ids, [0.0] * len(ids), response, "stop", 0, turns=turns, agent_reward=agent_reward
    )


def functions(*weighed: tuple[str, float]) -> RewardFunctions:
    return RewardFunctions.in_process(RewardScorer(list(weighed)))


def test_the_total_covers_the_functions_and_the_environment():
    scorer = RolloutScorer(
        [
            functions(("toy_task", 1.0), (f"{__name__}:_raises_on_odd", 0.5)),
            EnvironmentReward(),
        ],
        error_reward=-1.0,
    )
    one_turn = completion("3")
    rewarded = completion("2", [Turn("assistant", "2", 1, reward=0.25)])
    pop_state()
    [[odd], [even]] = asyncio.run(scorer.score([[one_turn], [rewarded]], ["3", "2"]))
    state = pop_state()
    assert odd == (1.0 - 0.5, {"toy_task": 1.0, f"{__name__}:_raises_on_odd": -1.0, "env": 0.0}, {})
    assert even == (
        1.0 + 0.5 + 0.25,
        {"toy_task": 1.0, f"{__name__}:_raises_on_odd": 1.0, "env": 0.25},
        {},
    )
    assert state["reward/total"].value() == (odd[0] + even[0]) / 2
    assert scorer.counts == {"errors": 1, "timeouts": 0}


def test_single_turn_rollouts_have_no_environment_source():
    """Without an environment (the built-in one-turn one) the breakdown has no ``env`` key."""
    [[scored]] = asyncio.run(RolloutScorer([functions(("toy_task", 1.0))]).score([[completion("3")]], ["3"]))
    assert scored == (1.0, {"toy_task": 1.0}, {})


def test_an_agents_reward_is_the_episodes_whole_reward():
    scorer = RolloutScorer([functions(("toy_task", 1.0)), EnvironmentReward(), AgentReward()])
    [[returned, scored]] = asyncio.run(
        scorer.score([[completion("3", agent_reward=0.25), completion("2")]], ["2"])
    )
    assert returned == (0.25, {"agent": 0.25}, {})
    assert scored == (1.0, {"toy_task": 1.0, "env": 0.0}, {})


class Judge:
    """A judge's client (`forge.rewards.sources.ModelClient`) whose answers are set by the test."""

    def __init__(self, answers):
        self.answers, self.calls = answers, 0

    async def answer(self, questions):
        self.calls += 1
        if isinstance(self.answers, Exception):
            raise self.answers
        answers, self.answers = self.answers[: len(questions)], self.answers[len(questions) :]
        return answers


def judge_config(**settings) -> RewardConfig:
    return RewardConfig.model_validate(
        {"error_reward": -1.0, "models": [{"name": "judge", "path": "unused", "kind": "judge", **settings}]}
    )


def test_a_judge_is_weighed_in_its_answers_kept_and_its_failures_score_error_reward_counted_once():
    cfg = judge_config(weight=0.5, batch_size=2)
    answered = Judge(["7/10", "no rating", "10/10"])
    scorer = RolloutScorer.for_run(cfg, functions(("toy_task", 1.0)), [answered])
    pop_state()
    [group] = asyncio.run(scorer.score([[completion("2")] * 3], ["2"]))
    state = pop_state()
    assert answered.calls == 2  # batch_size 2: three responses, two calls
    assert [total for total, _, _ in group] == [1.0 + 0.5 * 0.7, 1.0 + 0.5 * -1.0, 1.0 + 0.5 * 1.0]
    assert [notes for _, _, notes in group] == [{"judge": "7/10"}, {"judge": "no rating"}, {"judge": "10/10"}]
    assert state["reward/judge/errors"].value() == 1 and state["reward/judge/calls"].value() == 2
    assert state["reward/judge"].value() == pytest.approx((0.7 - 1.0 + 1.0) / 3)
    # A call that fails scores error_reward for each of its responses, and counts once.
    scorer = RolloutScorer.for_run(cfg, functions(("toy_task", 1.0)), [Judge(TimeoutError("hung"))])
    [group] = asyncio.run(scorer.score([[completion("2"), completion("2")]], ["2"]))
    assert [breakdown["judge"] for _, breakdown, _ in group] == [-1.0, -1.0]
    assert [notes for _, _, notes in group] == [{"judge": "(no answer: TimeoutError)"}] * 2
    assert scorer.counts == {"errors": 0, "timeouts": 1}
    assert isinstance(scorer.sources[1], RewardModel)
