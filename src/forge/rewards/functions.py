"""Reward functions: plain callables ``fn(prompt, response, target) -> float``.

Configs name them by their key in ``REWARD_FUNCTIONS`` or ``IMPORTED_REWARD_FUNCTIONS``, or by import path
(``"mypackage.rewards:my_reward"``) for a user's own.

| name          | values                                                                       |
|---------------|------------------------------------------------------------------------------|
| `exact_match` | 1.0 when the stripped response, or the content of its last `<answer>` tag, equals the stripped target; else 0.0 |
| `math_verify` | 1.0 when the answer (the last `<answer>` block, else what math-verify finds in the response: `\\boxed{}` answers first) equals the target as mathematics, by math-verify: `\\sqrt{8}` = `2\\sqrt{2}`, `x=2` = `2`, sets, intervals, `\\dfrac`, units; 0.0 otherwise (`forge.rewards.math_verify_reward`) |
| `math_answer` | 1.0 when the answer in the last `\\boxed{...}` or `<answer>...</answer>` equals the target numerically (integers exactly, others to a relative 1e-4) or, when not numeric, as text without whitespace; 0.0 otherwise, including when there is no tagged answer |
| `format`      | 1.0 for `<think>...</think><answer>...</answer>`, 0.5 for `<answer>...</answer>` alone, 0.25 for one answer block with other text around it, 0.0 otherwise |
| `toy_task`    | 1.0 for the right number (bare or in `<answer>` tags), 0.1 for a wrong but well-formed integer, 0.0 otherwise |
| `reasoning_gym` | the score, in [0, 1], of the `<answer>` block by the reasoning-gym task that made the row (`dataset.source: reasoning_gym`; `forge.rewards.reasoning_gym_reward`) |
| `distinct`    | a group reward: 1/k for a response that k responses of its group share (whitespace aside), 1.0 for one unlike the others (`forge.rewards.group_functions`) |

Math answers: use `math_verify`. `math_answer` is for answers that are plain numbers when the
cost of SymPy matters (microseconds a call, against milliseconds, and nothing that can hang), or
when a rounded decimal (``0.3333`` for 1/3) or ``1e3`` must count; it scores 0 for equal
expressions written differently (tests/data/test_math_verify.py lists where the two disagree).
"""

import importlib
import re
from collections.abc import Callable
from difflib import get_close_matches
from fractions import Fraction
from typing import Annotated

from pydantic import AfterValidator

from forge.rewards.group_functions import distinct_in_group, group_reward  # noqa: F401 (re-exported)

RewardFn = Callable[[str, str, str], float]

FORMAT_THINK_ANSWER = 1.0
FORMAT_ANSWER_ONLY = 0.5
FORMAT_ANSWER_WITH_EXTRA_TEXT = 0.25

TOY_CORRECT = 1.0
TOY_WELL_FORMED = 0.1

# Relative tolerance when either side is not an integer (0.3333 counts as 1/3).
MATH_REL_TOL = 1e-4

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# Block contents may not contain another think/answer tag: one block of each, in order.
_NO_TAG = r"(?:(?!</?think>|</?answer>).)"
_THINK_ANSWER_RE = re.compile(rf"\s*<think>{_NO_TAG}*</think>\s*<answer>({_NO_TAG}*)</answer>\s*", re.DOTALL)
_ANSWER_ONLY_RE = re.compile(rf"\s*<answer>({_NO_TAG}*)</answer>\s*", re.DOTALL)
_INTEGER_RE = re.compile(r"-?\d+")
_THOUSANDS_RE = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")
_LATEX_FRAC_RE = re.compile(r"(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")
_EXPONENT_RE = re.compile(r"[eE][+-]?(\d+)")
# Fraction builds 10**exponent exactly: 1e100000000 would take minutes. No answer a reward
# compares is that long or that large, so such text is not a number here.
MAX_NUMBER_CHARS = 100
MAX_EXPONENT = 1000


def extract_tagged_answer(response: str) -> str | None:
    """The stripped content of the last ``<answer>...</answer>`` block, or None."""
    matches = _ANSWER_RE.findall(response)
    return matches[-1].strip() if matches else None


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, braces balanced, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    content_start = start + len("\\boxed{")
    for i in range(content_start - 1, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[content_start:i].strip()
    return None


def parse_number(text: str) -> Fraction | None:
    """Parses integers, decimals, thousands separators (``1,234.5``), ``a/b`` and
    ``\\frac{a}{b}``, with optional ``$`` delimiters; None when not a number, or when it is
    too long or its exponent too large to parse cheaply."""
    text = text.strip().strip("$").replace("\\!", "").replace("\\,", "").replace(" ", "").rstrip(".")
    if _THOUSANDS_RE.fullmatch(text):
        text = text.replace(",", "")
    latex = _LATEX_FRAC_RE.fullmatch(text)
    if latex:
        sign, numerator, denominator = latex.groups()
        text = f"{sign}{numerator}/{denominator}"
    if len(text) > MAX_NUMBER_CHARS or any(int(e) > MAX_EXPONENT for e in _EXPONENT_RE.findall(text)):
        return None
    try:
        if text.count("/") == 1:
            numerator, denominator = text.split("/")
            return Fraction(numerator) / Fraction(denominator)
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def exact_match(prompt: str, response: str, target: str) -> float:
    target = target.strip()
    return 1.0 if target in (response.strip(), extract_tagged_answer(response)) else 0.0


def math_answer(prompt: str, response: str, target: str) -> float:
    answer = extract_tagged_answer(response)
    boxed = extract_boxed(answer if answer is not None else response)
    if boxed is not None:
        answer = boxed
    if answer is None:
        return 0.0
    answer_value, target_value = parse_number(answer), parse_number(target)
    if answer_value is None or target_value is None:
        return 1.0 if "".join(answer.split()) == "".join(target.split()) else 0.0
    if answer_value.denominator == 1 and target_value.denominator == 1:
        return 1.0 if answer_value == target_value else 0.0
    # math.isclose's rule, in exact arithmetic: a float conversion can overflow.
    tolerance = Fraction(str(MATH_REL_TOL)) * max(abs(answer_value), abs(target_value))
    return 1.0 if abs(answer_value - target_value) <= tolerance else 0.0


def format_reward(prompt: str, response: str, target: str) -> float:
    for pattern, reward in ((_THINK_ANSWER_RE, FORMAT_THINK_ANSWER), (_ANSWER_ONLY_RE, FORMAT_ANSWER_ONLY)):
        match = pattern.fullmatch(response)
        if match and match.group(1).strip():
            return reward
    single_block = response.count("<answer>") == 1 and response.count("</answer>") == 1
    answer = extract_tagged_answer(response)
    return FORMAT_ANSWER_WITH_EXTRA_TEXT if single_block and answer else 0.0


def toy_task_reward(prompt: str, response: str, target: str) -> float:
    answer = extract_tagged_answer(response)
    if answer is None:
        answer = response.strip()
    if answer == target.strip():
        return TOY_CORRECT
    return TOY_WELL_FORMED if _INTEGER_RE.fullmatch(answer) else 0.0


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "math_answer": math_answer,
    "format": format_reward,
    "toy_task": toy_task_reward,
    "distinct": distinct_in_group,
}


# Built-ins whose libraries are slow to import (SymPy; reasoning-gym's hundred generators), by
# import path: imported only for a config that names them, so importing this module stays cheap.
IMPORTED_REWARD_FUNCTIONS: dict[str, str] = {
    "math_verify": "forge.rewards.math_verify_reward:math_verify_reward",
    "reasoning_gym": "forge.rewards.reasoning_gym_reward:reasoning_gym_reward",
}


def get_reward_fn(name: str) -> RewardFn:
    """A built-in reward by name, or a user's as ``"package.module:function"``.

    An import path is resolved in whichever process scores, so the module must be
    importable there (installed, or on PYTHONPATH).
    """
    path = IMPORTED_REWARD_FUNCTIONS.get(name, name)
    if ":" in path:
        module_name, _, attr = path.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward function {name!r} cannot be imported: {e}") from None
        if not callable(fn):
            raise ValueError(f"reward function {name!r} is a {type(fn).__name__}, not a callable")
        return fn
    try:
        return REWARD_FUNCTIONS[name]
    except KeyError:
        known = sorted([*REWARD_FUNCTIONS, *IMPORTED_REWARD_FUNCTIONS])
        close = get_close_matches(name, known, n=1)
        guess = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown reward function {name!r}.{guess} Known: {known}, or give your own as "
            "'package.module:function'"
        ) from None


def _check_reward_fn_name(name: str) -> str:
    get_reward_fn(name)  # raises, naming the known functions, for an unknown name
    return name


# A config field naming a reward function: checked when the config is validated, at start-up.
RewardFnName = Annotated[str, AfterValidator(_check_reward_fn_name)]
