"""Reward functions on correct, wrong and malformed responses; the registry."""

import math
import os
import subprocess
import sys
import time

import psutil
import pytest
from scoring import Scored

from forge.rewards.functions import (
    REWARD_FUNCTIONS,
    exact_match,
    format_reward,
    get_reward_fn,
    math_answer,
    parse_number,
    toy_task_reward,
)


@pytest.mark.parametrize(
    ("response", "target", "expected"),
    [
        ("85", "85", 1.0),
        ("  85\n", "85 ", 1.0),
        ("so <answer>85</answer>", "85", 1.0),
        ("84", "85", 0.0),
        ("<answer>85", "85", 0.0),
        ("", "85", 0.0),
    ],
)
def test_exact_match(response, target, expected):
    assert exact_match("p", response, target) == expected


@pytest.mark.parametrize(
    ("response", "target", "expected"),
    [
        ("the answer is \\boxed{42}", "42", 1.0),
        ("<answer>1,234</answer>", "1234", 1.0),
        ("<answer>0.5</answer>", "1/2", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{-\\dfrac{3}{4}}", "-0.75", 1.0),
        ("<answer>0.3333</answer>", "1/3", 1.0),
        ("<answer>0.33</answer>", "1/3", 0.0),
        ("<answer>\\boxed{7}</answer>", "7", 1.0),
        ("\\boxed{\\text{{x}}} then \\boxed{2.50}", "2.5", 1.0),
        ("<answer>$3.$</answer>", "3", 1.0),
        ("<answer>1000001</answer>", "1000000", 0.0),
        ("<answer>x + 1</answer>", "x+1", 1.0),
        ("<answer>43</answer>", "42", 0.0),
        ("42", "42", 0.0),
        ("\\boxed{42", "42", 0.0),
        ("<answer>1/0</answer>", "1", 0.0),
    ],
)
def test_math_answer(response, target, expected):
    assert math_answer("p", response, target) == expected


def test_math_answer_refuses_numbers_too_large_to_parse_cheaply():
    # Refused before Fraction builds 10**100000000 (how long that takes: bench/math_answer_bench.py).
    assert parse_number("1e100000000") is None and parse_number("9" * 5000) is None
    assert math_answer("p", "\\boxed{1e100000000}", "1") == 0.0
    assert math_answer("p", "<answer>1e100000000</answer>", "1e100000000") == 1.0  # equal as text
    assert parse_number("1e3") == 1000 and parse_number("1e1001") is None
    # Tolerance compared exactly: no float conversion to overflow.
    assert math_answer("p", "<answer>2.5e999</answer>", "25e998") == 1.0


def test_parse_number():
    assert parse_number("1,234.5") == parse_number("1234.5") == pytest.approx(1234.5)
    assert parse_number(" -3/4 ") == parse_number("\\frac{-3}{4}") == -0.75
    assert parse_number("1,2") is None
    assert parse_number("abc") is None


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("<think>8+5 is 13</think><answer>13</answer>", 1.0),
        ("  <think>\nhm\n</think>\n<answer>13</answer>\n", 1.0),
        ("<answer>13</answer>", 0.5),
        ("I think <answer>13</answer>", 0.25),
        ("<think>a</think><answer> </answer>", 0.0),
        ("<answer>1</answer><answer>2</answer>", 0.0),
        ("<think>a</think>13", 0.0),
        ("13", 0.0),
    ],
)
def test_format_reward(response, expected):
    assert format_reward("p", response, "13") == expected


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("85", 1.0),
        (" 85 ", 1.0),
        ("<answer>85</answer>", 1.0),
        ("84", 0.1),
        ("<answer>-3</answer>", 0.1),
        ("8 5", 0.0),
        ("85=", 0.0),
        ("", 0.0),
    ],
)
def test_toy_task_reward(response, expected):
    assert toy_task_reward("37+48=", response, "85") == expected


def test_registry():
    assert set(REWARD_FUNCTIONS) >= {"exact_match", "math_answer", "format", "toy_task"}
    assert get_reward_fn("toy_task") is toy_task_reward
    with pytest.raises(
        ValueError,
        match=r"'exact_mach'.*\['distinct', 'exact_match', 'format', 'math_answer', 'math_verify', 'reasoning_gym', 'toy_task'\]",
    ):
        get_reward_fn("exact_mach")


def _raises_on_odd(prompt: str, response: str, target: str) -> float:
    if int(target) % 2:
        raise RuntimeError("odd targets break this reward")
    return 1.0


def test_scorer_gives_error_reward_counts_and_goes_on():
    from forge.observability.collector import pop_state
    from forge.rewards.scorer import RewardScorer

    pop_state()
    scorer = Scored(RewardScorer([("toy_task", 1.0), (f"{__name__}:_raises_on_odd", 0.5)]), -1.0)
    assert scorer.score_many([("1+2=", "3", "3")])[0] == (
        1.0 - 0.5,
        {"toy_task": 1.0, f"{__name__}:_raises_on_odd": -1.0},
    )
    assert scorer.score_many([("1+1=", "2", "2")])[0] == (
        1.0 + 0.5,
        {"toy_task": 1.0, f"{__name__}:_raises_on_odd": 1.0},
    )
    state = pop_state()
    assert state[f"reward/{__name__}:_raises_on_odd/errors"].value() == 1


def test_import_path_errors_name_the_path():
    from forge.rewards.functions import get_reward_fn

    with pytest.raises(ValueError, match="'no_such_module:fn' cannot be imported"):
        get_reward_fn("no_such_module:fn")
    with pytest.raises(ValueError, match="'math:pi' is a float, not a callable"):
        get_reward_fn("math:pi")


def _sleeps_on_target_7(prompt: str, response: str, target: str) -> float:
    if target == "7":
        time.sleep(3600)
    return 1.0


def _non_finite(prompt: str, response: str, target: str) -> float:
    return {"inf": math.inf, "nan": math.nan}.get(response, 1.0)


def test_scorer_times_out_hung_calls_and_goes_on():
    from forge.observability.collector import pop_state
    from forge.rewards.scorer import RewardScorer

    pop_state()
    name = f"{__name__}:_sleeps_on_target_7"
    scorer = Scored(RewardScorer([(name, 1.0), ("toy_task", 1.0)], timeout_s=0.5), -1.0)
    try:
        scores = scorer.score_many([("3+4=", "7", "7"), ("1+1=", "2", "2"), ("3+4=", "7", "7")])
        assert [total for total, _ in scores] == [-1.0 + 1.0, 1.0 + 1.0, -1.0 + 1.0]
        assert scores[1][1] == {name: 1.0, "toy_task": 1.0}
        assert scorer.counts == {"errors": 0, "timeouts": 2}
        assert pop_state()[f"reward/{name}/timeouts"].value() == 2
        worker = scorer.functions._worker._process.pid
        assert scorer.score_many([("1+1=", "2", "2")])[0] == (2.0, {name: 1.0, "toy_task": 1.0})
        assert (
            scorer.functions._worker._process.pid == worker
        )  # hung calls cost their runners, not the worker
    finally:
        scorer.close()


def test_scorer_treats_non_finite_rewards_as_errors():
    from forge.observability.collector import pop_state
    from forge.rewards.scorer import RewardScorer

    pop_state()
    name = f"{__name__}:_non_finite"
    scorer = Scored(RewardScorer([(name, 1.0)]), 0.0)
    assert [s for s, _ in scorer.score_many([("p", "inf", "t"), ("p", "nan", "t"), ("p", "x", "t")])] == [
        0.0,
        0.0,
        1.0,
    ]
    assert pop_state()[f"reward/{name}/errors"].value() == 2


# Hostile reward functions: each misbehaves on the response "bad" and returns 0.5 otherwise.
def _raises(prompt: str, response: str, target: str) -> float:
    if response == "bad":
        raise RuntimeError("this reward is broken")
    return 0.5


def _returns_none(prompt: str, response: str, target: str) -> float | None:
    return None if response == "bad" else 0.5


def _returns_a_string(prompt: str, response: str, target: str) -> float | str:
    return "0.5" if response == "bad" else 0.5  # float("0.5") would parse: still not a number


def _calls_sys_exit(prompt: str, response: str, target: str) -> float:
    if response == "bad":
        sys.exit(0)
    return 0.5


def _exits_its_process(prompt: str, response: str, target: str) -> float:
    if response == "bad":
        os._exit(1)  # like a crash in C code: no exception, the process is gone
    return 0.5


def _hangs(prompt: str, response: str, target: str) -> float:
    time.sleep(3600)
    return 0.5


def _prints_megabytes(prompt: str, response: str, target: str) -> float:
    sys.stdout.write("o" * 4_000_000 + "\n")
    sys.stderr.write("e" * 4_000_000 + "\n")
    return 0.5


def _maps_2_gib_on_big(prompt: str, response: str, target: str) -> float:
    if response == "big":
        bytes(2 * 2**30)  # calloc'd: without a limit it maps 2 GiB and touches none of it
    return 0.5


def test_a_call_past_the_memory_limit_scores_error_reward_is_counted_and_the_next_runs():
    from forge.observability.collector import pop_state
    from forge.rewards.scorer import RewardScorer

    pop_state()
    name = f"{__name__}:_maps_2_gib_on_big"
    scorer = Scored(
        RewardScorer([(name, 1.0), ("toy_task", 1.0)], timeout_s=30.0, memory_limit_gib=1.0), -1.0
    )
    try:
        scores = scorer.score_many([("1+1=", "big", "2"), ("1+1=", "2", "2")])
        assert [breakdown for _, breakdown in scores] == [
            {name: -1.0, "toy_task": 0.0},
            {name: 0.5, "toy_task": 1.0},
        ]
        assert scorer.counts == {"errors": 1, "timeouts": 0}
        assert pop_state()[f"reward/{name}/errors"].value() == 1
        assert scorer.score_many([("1+1=", "2", "2")])[0] == (1.5, {name: 0.5, "toy_task": 1.0})
    finally:
        scorer.close()


@pytest.mark.parametrize("timeout_s", [None, 5.0], ids=["in_process", "worker"])
def test_anything_but_a_number_scores_error_reward_is_counted_and_the_calls_go_on(timeout_s):
    from forge.observability.collector import pop_state
    from forge.rewards.scorer import RewardScorer

    pop_state()
    hostile = [_raises, _returns_none, _returns_a_string, _calls_sys_exit]
    if timeout_s:  # in process, os._exit would end pytest itself
        hostile.append(_exits_its_process)
    names = [f"{__name__}:{fn.__name__}" for fn in hostile]
    scorer = Scored(RewardScorer([(name, 1.0) for name in names], timeout_s=timeout_s), -1.0)
    try:
        scores = scorer.score_many([("p", "good", "t"), ("p", "bad", "t"), ("p", "good", "t")])
        assert [breakdown for _, breakdown in scores] == [
            dict.fromkeys(names, 0.5),
            dict.fromkeys(names, -1.0),
            dict.fromkeys(names, 0.5),
        ]
        state = pop_state()
        assert {name: state[f"reward/{name}/errors"].value() for name in names} == dict.fromkeys(names, 1)
        assert scorer.counts == {"errors": len(names), "timeouts": 0}
    finally:
        scorer.close()


def test_hung_calls_of_a_batch_time_out_together_not_one_after_another():
    from forge.rewards.scorer import RewardScorer

    hangs, by_length = f"{__name__}:_hangs", "toy_task"
    scorer = Scored(RewardScorer([(hangs, 1.0), (by_length, 1.0)], timeout_s=1.0), -1.0)
    try:
        scorer.score_many([("1+1=", "2", "2")])[
            0
        ]  # the worker has started: what follows times only the batch
        start = time.monotonic()
        scores = scorer.score_many([("1+1=", str(n), "2") for n in range(6)])
        took = time.monotonic() - start
        # One after another, six hung calls would take over 6 s; together, about 2 (the first
        # hang, then the five others at once), which a loaded machine may stretch a little.
        assert took < 4.0, f"6 hung calls took {took:.1f} s"
        assert [breakdown for _, breakdown in scores] == [
            {hangs: -1.0, by_length: 1.0 if n == 2 else 0.1} for n in range(6)
        ]
        assert scorer.counts == {"errors": 0, "timeouts": 7}
    finally:
        scorer.close()


def test_megabytes_of_output_from_a_reward_function_break_nothing(capfd):
    from forge.rewards.scorer import RewardScorer

    scorer = Scored(RewardScorer([(f"{__name__}:_prints_megabytes", 1.0)], timeout_s=5.0))
    try:
        assert [total for total, _ in scorer.score_many([("p", "r", "t")] * 3)] == [0.5] * 3
        assert scorer.counts == {"errors": 0, "timeouts": 0}
    finally:
        scorer.close()
    out, err = capfd.readouterr()
    assert out.count("o" * 4_000_000) == err.count("e" * 4_000_000) == 3  # written, not lost


def test_the_worker_and_its_runners_die_with_the_process_that_started_them(tmp_path):
    """A process that dies however it dies (here SIGKILL, in the middle of a hung call) leaves
    no reward worker and no runner behind."""
    script = f"""
import sys
from forge.rewards.scorer import RewardScorer
scorer = RewardScorer([("{__name__}:_hangs", 1.0)], timeout_s=600)
scorer.start()
print(scorer._worker._process.pid, flush=True)
scorer.score_many([("p", "r", "t")])[0]
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        worker = psutil.Process(int(parent.stdout.readline()))
        deadline = time.monotonic() + 60
        while not worker.children():  # the runner of the hung call
            assert time.monotonic() < deadline, "the worker started no runner"
            time.sleep(0.05)
        [runner] = worker.children()
        parent.kill()
        parent.wait()
        gone, alive = psutil.wait_procs([worker, runner], timeout=10)
        assert alive == [], f"left behind: {[p.cmdline() for p in alive]}"
    finally:
        parent.kill()
