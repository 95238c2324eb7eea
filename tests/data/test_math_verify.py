"""The `math_verify` reward (real math-verify): where it and `math_answer` disagree, and how it is
contained (no time limit of its own, the reward worker's instead)."""

import logging
import subprocess
import sys
import threading

import pytest
from scoring import Scored

from forge.rewards.functions import get_reward_fn, math_answer
from forge.rewards.math_verify_reward import math_verify_reward

# (response, target, math_verify, math_answer): every pair the two score differently.
DISAGREEMENTS = [
    # Equal values written differently: math_answer compares numbers or text only.
    (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", 1.0, 0.0),
    (r"<answer>3\sqrt{2}</answer>", r"\sqrt{18}", 1.0, 0.0),
    (r"<answer>\sqrt{2}/2</answer>", r"\frac{1}{\sqrt{2}}", 1.0, 0.0),
    (r"\boxed{\pi/2}", r"\frac{\pi}{2}", 1.0, 0.0),
    (r"<answer>x^2+2x+1</answer>", "(x+1)^2", 1.0, 0.0),
    (r"<answer>1 + x</answer>", "x+1", 1.0, 0.0),
    (r"<answer>2 + 3i</answer>", "3i + 2", 1.0, 0.0),
    (r"<answer>2^{10}</answer>", "1024", 1.0, 0.0),
    # \frac{1}{2} against 0.5 inside an expression (math_answer reads a lone fraction only).
    (r"\boxed{x+\frac{1}{2}}", "x+0.5", 1.0, 0.0),
    (r"\boxed{\frac{1}{2}x}", "0.5x", 1.0, 0.0),
    (r"<answer>\frac{1}{2} + \sqrt{2}</answer>", r"0.5+\sqrt{2}", 1.0, 0.0),
    # \dfrac and \tfrac against \frac inside larger expressions.
    (r"\boxed{\dfrac{\pi}{2}+1}", r"\frac{\pi}{2}+1", 1.0, 0.0),
    (r"\boxed{2\dfrac{\sqrt{3}}{3}}", r"\frac{2\sqrt{3}}{3}", 1.0, 0.0),
    (r"<answer>\dfrac{1}{2}x+1</answer>", r"\frac{1}{2}x+1", 1.0, 0.0),
    (r"<answer>\tfrac{3}{4}</answer>", r"\frac34", 1.0, 0.0),
    # An equation for its value, both ways.
    (r"\boxed{x=2}", "2", 1.0, 0.0),
    (r"<answer>x = 2</answer>", "2", 1.0, 0.0),
    (r"<answer>2</answer>", "x=2", 1.0, 0.0),
    # Intervals.
    (r"<answer>\left[1, 2\right)</answer>", "[1,2)", 1.0, 0.0),
    (r"<answer>(3,4) \cup (1,2)</answer>", r"(1,2) \cup (3,4)", 1.0, 0.0),
    (r"<answer>[1, 2)</answer>", r"1 \le x < 2", 1.0, 0.0),
    (r"<answer>(-\infty, 3]</answer>", r"x \le 3", 1.0, 0.0),
    # Sets: order and repeats do not matter.
    (r"\boxed{\{3,2,1\}}", r"\{1,2,3\}", 1.0, 0.0),
    (r"<answer>\{1, 2, 2, 3\}</answer>", r"\{3,2,1\}", 1.0, 0.0),
    (r"<answer>3, 1, 2</answer>", r"\{1,2,3\}", 1.0, 0.0),
    # Units, percent and text around the answer.
    (r"<answer>45^\circ</answer>", "45", 1.0, 0.0),
    (r"<answer>10\%</answer>", "10", 1.0, 0.0),
    (r"<answer>5 apples</answer>", "5", 1.0, 0.0),
    (r"<answer>\text{(B)}</answer>", "B", 1.0, 0.0),
    (r"<answer>Paris</answer>", "paris", 1.0, 0.0),
    # No tags: math_verify finds the answer in the text, math_answer wants <answer> or \boxed.
    ("The answer is 4", "4", 1.0, 0.0),
    # Where math_answer is right and math_verify is not: plain-text scientific notation ...
    (r"<answer>1e3</answer>", "1000", 0.0, 1.0),
    # ... and a rounded decimal of a repeating one (math_answer: relative 1e-4; math_verify
    # wants 6 decimal places).
    (r"<answer>0.3333</answer>", "1/3", 0.0, 1.0),
    (r"<answer>1/3</answer>", "0.3333", 0.0, 1.0),
    # Several boxed answers: math_answer takes the last, math_verify the set of all (a hedge).
    (r"\boxed{3}. So \boxed{4}", "4", 0.0, 1.0),
]


@pytest.mark.parametrize(("response", "target", "verify_says", "answer_says"), DISAGREEMENTS)
def test_math_verify_and_math_answer_disagree(response, target, verify_says, answer_says):
    assert math_verify_reward("p", response, target) == verify_says
    assert math_answer("p", response, target) == answer_says


@pytest.mark.parametrize(
    ("response", "target"),
    [
        (r"\boxed{(1, 2]}", "[1,2)"),
        (r"\boxed{\{1,2\}}", r"\{1,2,3\}"),
        (r"\boxed{\dfrac{\pi}{3}+1}", r"\frac{\pi}{2}+1"),
        (r"\boxed{x=3}", "2"),
        (r"\boxed{y = 2}", "x=2"),
        (r"\boxed{2\sqrt{3}}", r"\sqrt{8}"),
        ("<answer>1000001</answer>", "1000000"),
        ("<answer>-7</answer>", "7"),
        ("<answer></answer>", "7"),
        ("no answer here", "7"),
        ("", "7"),
    ],
)
def test_math_verify_wrong_answers_score_zero(response, target):
    assert math_verify_reward("p", response, target) == 0.0


def test_a_target_math_verify_cannot_read_is_an_error():
    with pytest.raises(ValueError, match=r"cannot read the target '\\\\\$5'.*math_answer or exact_match"):
        math_verify_reward("p", "<answer>5</answer>", r"\$5")


def test_registered_but_imported_only_when_named():
    assert get_reward_fn("math_verify") is math_verify_reward
    code = "import sys, forge.rewards.functions; print('math_verify' in sys.modules, 'sympy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_runs_off_the_main_thread_without_its_own_timeout_or_warning(caplog):
    # math-verify's SIGALRM time limits would raise off the main thread (an actor's endpoint
    # thread); they are off, and so is the warning that says so.
    scores = []
    with caplog.at_level(logging.WARNING):
        thread = threading.Thread(target=lambda: scores.append(math_verify_reward("p", r"\boxed{x=2}", "2")))
        thread.start()
        thread.join()
    assert scores == [1.0]
    assert not [r for r in caplog.records if r.name.startswith("math_verify")]


def test_worker_times_out_what_math_verify_cannot_finish():
    from forge.rewards.scorer import RewardScorer

    # 10^{10^{10}} hangs inside one big-integer power, where no signal reaches Python: only the
    # reward worker's kill ends it, and the calls around it are scored as usual.
    scorer = Scored(RewardScorer([("math_verify", 1.0)], timeout_s=3.0), -1.0)
    try:
        items = [
            ("p", r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
            ("p", r"\boxed{10^{10^{10}}}", "1"),
            ("p", "5", "4"),
        ]
        assert [total for total, _ in scorer.score_many(items)] == [1.0, -1.0, 0.0]
        assert scorer.counts == {"errors": 0, "timeouts": 1}
    finally:
        scorer.close()
