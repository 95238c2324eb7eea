"""Group reward functions score a whole group in one call, beside per-response functions, and
fail like them: a group call that does not return one finite number per response scores
error_reward for its group, is counted once, and the other groups are scored."""

import math
import os
import time

import numpy as np
import pytest
from scoring import Scored

from forge.observability.collector import pop_state
from forge.rewards.group_functions import distinct_in_group, group_reward, is_group_reward
from forge.rewards.scorer import RewardScorer

CALLS_FILE = "GROUP_REWARD_TEST_CALLS"


@group_reward
def _rank_by_length(prompts: list[str], responses: list[str], targets: list[str]) -> list[float]:
    """The longest response of its group scores 1.0, the shortest 0.0; logs each call."""
    if CALLS_FILE in os.environ:
        with open(os.environ[CALLS_FILE], "a") as calls:
            calls.write(f"{len(responses)} {targets[0]} {prompts[0]}\n")
    order = sorted(range(len(responses)), key=lambda j: len(responses[j]))
    ranks = [0.0] * len(responses)
    for rank, j in enumerate(order):
        ranks[j] = rank / max(len(responses) - 1, 1)
    return ranks


def test_group_reward_marks_the_function_and_distinct_rewards_unlike_responses():
    assert is_group_reward(_rank_by_length) and is_group_reward(distinct_in_group)
    assert not is_group_reward(lambda p, r, t: 1.0)
    assert distinct_in_group(["p"] * 4, ["a", " a ", "b", "c"], ["t"] * 4) == [0.5, 0.5, 1.0, 1.0]
    assert distinct_in_group(["p"] * 2, ["x", "x"], ["t"] * 2) == [0.5, 0.5]


@pytest.mark.parametrize("timeout_s", [None, 5.0], ids=["in_process", "worker"])
def test_a_group_function_is_called_once_per_group_and_weighed_with_the_others(
    timeout_s, tmp_path, monkeypatch
):
    calls = tmp_path / "calls"
    monkeypatch.setenv(CALLS_FILE, str(calls))  # before the worker starts: it inherits it
    pop_state()
    rank = f"{__name__}:_rank_by_length"
    scorer = Scored(RewardScorer([("toy_task", 1.0), (rank, 0.5)], timeout_s=timeout_s), -1.0)
    try:
        scores = scorer.score_groups(
            [["1+1="] * 3, ["3+4=", "3+4= then", "3+4=", "3+4="]],
            [["2", "22", "222"], ["7", "77", "1", "x"]],
            ["2", "7"],
        )
    finally:
        scorer.close()
    assert [[breakdown for _, breakdown in group] for group in scores] == [
        [{"toy_task": 1.0, rank: 0.0}, {"toy_task": 0.1, rank: 0.5}, {"toy_task": 0.1, rank: 1.0}],
        [
            {"toy_task": 1.0, rank: 0.0},
            {"toy_task": 0.1, rank: 1.0},
            {"toy_task": 0.1, rank: 1 / 3},
            {"toy_task": 0.0, rank: 2 / 3},
        ],
    ]
    assert [total for total, _ in scores[0]] == [1.0, 0.1 + 0.25, 0.1 + 0.5]
    # One call per group, with the group's prompts (each response's own) and its target.
    assert calls.read_text().splitlines() == ["3 2 1+1=", "4 7 3+4="]
    state = pop_state()
    assert state[f"reward/{rank}"].value() == pytest.approx((0 + 0.5 + 1 + 0 + 1 + 1 / 3 + 2 / 3) / 7)
    assert scorer.counts == {"errors": 0, "timeouts": 0}


# Hostile group functions: each misbehaves on a group that holds the response "bad", and
# scores 0.5 for each response of any other group.
@group_reward
def _wrong_length(prompts, responses, targets):
    return [0.5] * (len(responses) - ("bad" in responses))


@group_reward
def _a_nan(prompts, responses, targets):
    return [math.nan if r == "bad" else 0.5 for r in responses]


@group_reward
def _returns_a_number(prompts, responses, targets):
    return 0.5 if "bad" in responses else [0.5] * len(responses)


@group_reward
def _returns_strings(prompts, responses, targets):
    return ["0.5"] * len(responses) if "bad" in responses else [0.5] * len(responses)


@group_reward
def _raises(prompts, responses, targets):
    if "bad" in responses:
        raise RuntimeError("this judge is broken")
    return np.full(len(responses), 0.5)  # a numpy vector is a list of numbers too


@group_reward
def _exits_its_process(prompts, responses, targets):
    if "bad" in responses:
        os._exit(1)  # like a crash in C code: no exception, the process is gone
    return [0.5] * len(responses)


@group_reward
def _hangs(prompts, responses, targets):
    if "bad" in responses:
        time.sleep(3600)
    return (0.5,) * len(responses)


@pytest.mark.parametrize("timeout_s", [None, 2.0], ids=["in_process", "worker"])
def test_a_failed_group_call_scores_error_reward_for_its_group_is_counted_once_and_others_go_on(
    timeout_s,
):
    pop_state()
    hostile = [_wrong_length, _a_nan, _returns_a_number, _returns_strings, _raises]
    if timeout_s:  # in process, these would end or hang pytest itself
        hostile += [_exits_its_process, _hangs]
    names = [f"{__name__}:{fn.__name__}" for fn in hostile]
    scorer = Scored(RewardScorer([(name, 1.0) for name in names], timeout_s=timeout_s), -1.0)
    try:
        scores = scorer.score_groups(
            [["p"] * 2, ["p"] * 3, ["p"] * 2],
            [["good", "fine"], ["good", "bad", "fine"], ["ok", "good"]],
            ["t", "t", "t"],
        )
        assert [[breakdown for _, breakdown in group] for group in scores] == [
            [dict.fromkeys(names, 0.5)] * 2,
            [dict.fromkeys(names, -1.0)] * 3,
            [dict.fromkeys(names, 0.5)] * 2,
        ]
        state = pop_state()
        errors = [n for n in names if not n.endswith("_hangs")]
        assert {n: state[f"reward/{n}/errors"].value() for n in errors} == dict.fromkeys(errors, 1)
        assert scorer.counts == {"errors": len(errors), "timeouts": len(names) - len(errors)}
        if timeout_s:
            assert state[f"reward/{__name__}:_hangs/timeouts"].value() == 1
            # The worker outlived its runners' hang and exit: the next batch is scored.
            assert scorer.score_groups([["p"]], [["good"]], ["t"])[0][0][1] == dict.fromkeys(names, 0.5)
    finally:
        scorer.close()


def test_a_group_function_beside_the_reward_functions_of_score_many_sees_groups_of_one():
    # score and score_many take independent responses: each is a group of its own.
    scorer = Scored(RewardScorer([("forge.rewards.group_functions:distinct_in_group", 1.0)]))
    assert (
        scorer.score_many([("p", "a", "t"), ("p", "a", "t")])
        == [(1.0, {"forge.rewards.group_functions:distinct_in_group": 1.0})] * 2
    )
