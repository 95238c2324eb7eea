"""The `math_verify` reward: math answers compared as mathematics, by math-verify (Hugging Face).

math-verify parses LaTeX and plain expressions into SymPy and compares them symbolically and
numerically, so ``\\sqrt{8}`` equals ``2\\sqrt{2}``, ``x=2`` equals ``2``, ``\\{3,2,1\\}`` equals
``\\{1,2,3\\}`` and a target ``x \\le 3`` accepts ``(-\\infty, 3]``. The answer is the content of the
response's last ``<answer>...</answer>`` block when it has one, else whatever math-verify
extracts from the whole response: its ``\\boxed{}`` answers (several make a set, so the hedge
``\\boxed{3}, or \\boxed{4}`` does not match the target 4), else its last expression.

This module imports math-verify (and SymPy) when it is imported: `forge.rewards.functions` imports it
only for a config that names the reward, and the reward worker imports it once, before it forks
the processes that score (see `forge.rewards.worker`).
"""

from __future__ import annotations

import re

from math_verify import grader, parse, parser, verify

from forge.rewards.functions import extract_tagged_answer

# math-verify's own time limits use SIGALRM, which works on a process's main thread only and
# cannot interrupt one long C call (``10^{10^{10}}`` hangs inside a single big-integer power).
# The reward worker kills a call that runs past `reward.timeout_s` instead, so they are off.
# Off, math-verify warns once per process; every batch is scored in a fresh fork of the worker,
# which would repeat the warning for each batch: it is said here, once.
parser.TIMEOUT_WARNING_SHOWN = grader.TIMEOUT_WARNING_SHOWN = True

# Text that already says where its mathematics is: $...$, \(...\), \[...\] or \boxed{}.
_DELIMITED_RE = re.compile(r"\$|\\\(|\\\[|\\boxed")


def as_latex(text: str) -> str:
    """``text`` as LaTeX math: math-verify reads a bare ``\\sqrt{8}`` or ``0.5`` only between
    delimiters, so an answer or target without any is put between ``$``s."""
    return text if _DELIMITED_RE.search(text) else f"${text}$"


def math_verify_reward(prompt: str, response: str, target: str) -> float:
    """1.0 when the response's answer equals the target mathematically, else 0.0 (see the module
    docstring). A target math-verify cannot read at all raises: every response would score 0."""
    gold = parse(as_latex(target.strip()), parsing_timeout=None)
    if not gold:
        raise ValueError(
            f"math-verify cannot read the target {target[:200]!r}: give targets as numbers or LaTeX, "
            "or score this dataset with math_answer or exact_match"
        )
    answer = extract_tagged_answer(response)
    predicted = parse(response if answer is None else as_latex(answer), parsing_timeout=None)
    return 1.0 if verify(gold, predicted, timeout_seconds=None) else 0.0
