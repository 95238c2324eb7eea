"""The greedy eval: each eval row's greedy trajectory, scored on the model's last turn.

Its accuracy is the share of rows answered with the full reward (1.0); a row whose environment
failed counts as not solved. The app (over actor handles), the serial recipe and SFT's
generation eval all measure accuracy with `greedy_accuracy`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from forge.data.types import Completion
from forge.rewards.sources import RolloutScorer
from forge.rollout.records import RolloutRecorder
from forge.rollout.step import Rollouts

FULL_REWARD = 1.0


@dataclass
class EvalScores:
    """The share of rows answered with the full reward, and the mean reward of the rows that
    got an answer (the one to watch with a shaped reward)."""

    accuracy: float
    reward_mean: float


def greedy_accuracy(scores: Sequence[float], num_rows: int) -> float:
    """The share of `num_rows` rows whose answer scored the full reward; `scores` holds one score
    per answered row (a row without an answer is not solved)."""
    return sum(s == FULL_REWARD for s in scores) / num_rows if num_rows else float("nan")


@dataclass
class ScoredAnswers:
    """The eval's answered rows (their completions and targets) and each one's score."""

    completions: list[Completion]
    targets: list[str]
    scores: list[float]


async def score_answers(
    rows: list[dict], groups: list[list[Completion] | None], scorer: RolloutScorer
) -> tuple[EvalScores, ScoredAnswers]:
    """Scores each row's greedy trajectory (a group of one; None where its environment failed)
    with `scorer` (its totals recorded in ``<scorer's prefix>/total``); one whose score failed
    (counted) has the error reward."""
    answered = [(g, r["target"]) for g, r in zip(groups, rows, strict=True) if g is not None]
    scored = await scorer.score([g for g, _ in answered], [t for _, t in answered])
    scores = [total for [(total, _, _)] in scored]
    mean = sum(scores) / len(scores) if scores else float("nan")
    answers = ScoredAnswers([g[0] for g, _ in answered], [t for _, t in answered], scores)
    return EvalScores(greedy_accuracy(scores, len(rows)), mean), answers


async def greedy_eval(
    rollouts: Rollouts,
    rows: list[dict],
    scorer: RolloutScorer,
    max_tokens: int,
    min_version: int = 0,
    recorder: RolloutRecorder | None = None,
) -> EvalScores:
    """`score_answers` of each of `rows`' greedy trajectory, by a policy of at least
    `min_version`; the `recorder` gets every answer, as eval records."""
    if not rows:
        return EvalScores(float("nan"), float("nan"))
    groups = await rollouts.groups(rows, None, min_version, 1, max_tokens=max_tokens, temperature=0.0)
    scores, answers = await score_answers(rows, groups, scorer)
    if recorder is not None:
        recorder.record_eval(answers.completions, answers.targets, answers.scores)
    return scores
