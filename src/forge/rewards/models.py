"""Reward models as a reward source: classifiers and generative judges that score a rollout's
responses. No Monarch: each model is reached through a client, an actor service in the app
(`forge.actors.reward_models`) or an engine in this process in the serial recipe
(`forge.recipes.reward_models`), and both are scored by the same `RewardModels`.

A rollout's responses go to each model in calls of `batch_size` (one call when they fit), all
models and calls at once. A call that fails scores ``reward.error_reward`` for its responses and
is counted in reward/<name>/errors, or reward/<name>/timeouts when it missed its deadline
(`forge.rewards.failures`); a value that is no finite number (a classifier's nan, a judge's
answer that its rule does not read) is an error of that response alone. A judge's answers are
kept (`ModelScores.notes`, then `Episode.reward_notes`), so that the rollout records show why a
response scored what it did.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from forge.observability import Reduce, record_metric
from forge.rewards.failures import RewardFailures
from forge.rewards.judge import judge_question

if TYPE_CHECKING:
    from forge.actors.reward import RewardModelConfig


class ModelClient(Protocol):
    """How one reward model is called: `classify` for a classifier, `answer` for a judge. A call
    that missed its deadline raises `TimeoutError`."""

    async def classify(self, prompts: list[str], responses: list[str]) -> list[float]: ...
    async def answer(self, questions: list[str]) -> list[str]: ...


@dataclass
class ModelScores:
    """One model's values for a rollout's responses, and a judge's answers (None: a classifier)."""

    values: list[float]
    notes: list[str] | None = None


@dataclass
class RewardModels:
    """The run's reward models (config, client), as the rollout's scoring calls them."""

    models: list[tuple[RewardModelConfig, ModelClient]]
    error_reward: float = 0.0
    failures: RewardFailures = field(init=False)

    def __post_init__(self) -> None:
        self.failures = RewardFailures(self.error_reward)

    @property
    def counts(self) -> dict[str, int]:
        """Failed calls and unreadable values since the start (read by the starvation report)."""
        return self.failures.counts

    def weighted_total(self, values: dict[str, float]) -> float:
        """What one response's {model name: value} adds to its reward."""
        weights = {m.name: m.weight for m, _ in self.models}
        return sum(weights[name] * value for name, value in values.items())

    async def score(
        self, prompts: list[str], responses: list[str], targets: list[str]
    ) -> dict[str, ModelScores]:
        """{model name: its scores} of the responses (one prompt and target per response)."""
        scored = await asyncio.gather(
            *(self._score(m, client, prompts, responses, targets) for m, client in self.models)
        )
        return {m.name: s for (m, _), s in zip(self.models, scored, strict=True)}

    async def _score(self, m: RewardModelConfig, client, prompts, responses, targets) -> ModelScores:
        batches = [slice(i, i + m.batch_size) for i in range(0, len(responses), m.batch_size)]
        parts = await asyncio.gather(
            *(self._call(m, client, prompts[b], responses[b], targets[b]) for b in batches)
        )
        scores = ModelScores(
            [v for p in parts for v in p.values],
            None if m.kind == "classifier" else [n for p in parts for n in p.notes],
        )
        for value in scores.values:
            record_metric(f"reward/{m.name}", value, Reduce.MEAN)
        return scores

    async def _call(self, m: RewardModelConfig, client, prompts, responses, targets) -> ModelScores:
        record_metric(f"reward/{m.name}/calls", 1, Reduce.SUM)
        try:
            if m.kind == "classifier":
                values = await client.classify(prompts, responses)
                texts = None
            else:
                questions = [
                    judge_question(m.template, *item)
                    for item in zip(prompts, responses, targets, strict=True)
                ]
                texts = await client.answer(questions)
                values = [m.parse.score(text) for text in texts]
        except TimeoutError as e:
            return self._failed(m, "timeouts", e, len(responses))
        # Every replica it tried died or hung, or the model itself raised.
        except Exception as e:
            return self._failed(m, "errors", e, len(responses))
        for i, value in enumerate(values):
            if value is None or not math.isfinite(value):
                if texts is None:
                    why = f"scored {value} on {responses[i][:200]!r}"
                else:
                    why = f"answered {texts[i][:200]!r}, which parse.regex {m.parse.regex!r} does not match"
                [values[i]] = self.failures.failed(m.name, "errors", f"reward model '{m.name}' {why}", 1)
        return ModelScores(values, texts)

    def _failed(self, m: RewardModelConfig, kind: str, error: BaseException, size: int) -> ModelScores:
        why = f"failed on a call of {size} responses: {error}".splitlines()[0]
        values = self.failures.failed(m.name, kind, f"reward model '{m.name}' {why}", size)
        note = f"(no answer: {type(error).__name__})"
        return ModelScores(values, None if m.kind == "classifier" else [note] * size)
