"""Reward models: a classifier actor, a judge (a frozen `Generator`), and how a rollout calls them.

Each model of `reward.models` runs as a service, also with one replica: a replica that dies or
misses its call's deadline (`timeout_s`) is replaced and the call retried
(forge.controller.service), where a lone actor's death would stop the run and a hung one,
killed, would leave every later rollout unscored. A call that fails for good scores
`reward.error_reward` for its responses and is counted in reward/<name>/errors (or /timeouts
when the judge's lone call hung); the run goes on, as it does for reward functions.

A rollout's responses go to each model in calls of `batch_size` (one call when they fit), all
models and calls at once. A judge's answers are kept in `Episode.reward_notes`, so that the
rollout records show why a response scored what it did.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any

from monarch.actor import endpoint

from forge.actors.generator import Generator, GeneratorConfig
from forge.actors.reward import RewardConfig, RewardModelConfig
from forge.controller import ForgeActor
from forge.controller.gpu_plan import TRAINER_GROUP
from forge.controller.liveness import ActorHungError
from forge.controller.service import ReplicaHungError
from forge.observability import Reduce, record_metric
from forge.rewards.failures import RewardFailures
from forge.rewards.judge import judge_question


class ClassifierRewardModel(ForgeActor):
    """Scores (prompt, response) pairs with a sequence-classification model
    (forge.engines.reward_classifier)."""

    def __init__(self, path: str, batch_size: int = 32, dtype: str = "float32"):
        self.path, self.batch_size, self.dtype = path, batch_size, dtype

    @endpoint
    async def setup(self) -> None:
        from forge.engines.reward_classifier import ClassifierRewardEngine

        self.engine = ClassifierRewardEngine(self.path, self.batch_size, self.dtype)

    @endpoint
    async def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        return self.engine.score(prompts, responses)


def judge_generator_config(m: RewardModelConfig) -> GeneratorConfig:
    """The judge's generator: its model, engine and sampling (n=1, greedy unless configured)."""
    return GeneratorConfig(
        model_path=m.path, engine=m.engine, dtype=m.dtype, vllm=m.vllm, sampling=m.sampling
    )


async def launch_reward_model(m: RewardModelConfig, gpus: bool) -> Any:
    """A service of `m.replicas` copies of the model; with GPUs, each on its own or the trainer's."""
    placement = dict(
        num_replicas=m.replicas, with_gpus=gpus, gpu_group=TRAINER_GROUP if m.gpu == "trainer" else None
    )
    if m.kind == "classifier":
        return await ClassifierRewardModel.options(**placement).as_service(m.path, m.batch_size, m.dtype)
    return await Generator.options(**placement).as_service(judge_generator_config(m), follows_policy=False)


@dataclass
class ModelScores:
    """One model's values for a rollout's responses, and a judge's answers (None: a classifier)."""

    values: list[float]
    notes: list[str] | None = None


@dataclass
class RewardModels:
    """The run's reward models (config, service handle), as `forge.rollout.step.score_groups` calls them."""

    models: list[tuple[RewardModelConfig, Any]]
    error_reward: float = 0.0
    failures: RewardFailures = field(init=False)

    def __post_init__(self) -> None:
        self.failures = RewardFailures(self.error_reward)

    @property
    def counts(self) -> dict[str, int]:
        """Failed calls and unreadable values since the start (read by the starvation report)."""
        return self.failures.counts

    @classmethod
    async def launch(cls, cfg: RewardConfig, gpus: bool) -> RewardModels:
        handles = await asyncio.gather(*(launch_reward_model(m, gpus) for m in cfg.models))
        return cls(list(zip(cfg.models, handles, strict=True)), cfg.error_reward)

    def weighted_total(self, values: dict[str, float]) -> float:
        """What one response's {model name: value} adds to its reward."""
        weights = {m.name: m.weight for m, _ in self.models}
        return sum(weights[name] * value for name, value in values.items())

    async def score(
        self, prompts: list[str], responses: list[str], targets: list[str]
    ) -> dict[str, ModelScores]:
        """{model name: its scores} of the responses (one prompt and target per response)."""
        scored = await asyncio.gather(
            *(self._score(m, h, prompts, responses, targets) for m, h in self.models)
        )
        return {m.name: s for (m, _), s in zip(self.models, scored, strict=True)}

    async def _score(self, m: RewardModelConfig, handle, prompts, responses, targets) -> ModelScores:
        batches = [slice(i, i + m.batch_size) for i in range(0, len(responses), m.batch_size)]
        parts = await asyncio.gather(
            *(self._call(m, handle, prompts[b], responses[b], targets[b]) for b in batches)
        )
        scores = ModelScores(
            [v for p in parts for v in p.values],
            None if m.kind == "classifier" else [n for p in parts for n in p.notes],
        )
        for value in scores.values:
            record_metric(f"reward/{m.name}", value, Reduce.MEAN)
        return scores

    async def _call(self, m: RewardModelConfig, handle, prompts, responses, targets) -> ModelScores:
        record_metric(f"reward/{m.name}/calls", 1, Reduce.SUM)
        try:
            if m.kind == "classifier":
                values = await handle.score.route_within(m.timeout_s, prompts, responses)
                texts = None
            else:
                questions = [
                    judge_question(m.template, *item)
                    for item in zip(prompts, responses, targets, strict=True)
                ]
                answers = await handle.generate_batch.route_within(m.timeout_s, questions)
                texts = [completions[0].text for completions in answers]
                values = [m.parse.score(text) for text in texts]
        except (ActorHungError, ReplicaHungError) as e:  # the last replica it tried hung
            return self._failed(m, "timeouts", e, len(responses))
        # Every replica it tried died or hung (ReplicaFailedError, NoHealthyReplicaError), or the
        # model's endpoint raised (the replica itself is fine).
        except Exception as e:
            return self._failed(m, "errors", e, len(responses))
        # A value that is no finite number (a classifier's nan, a judge's answer that the rule
        # does not read) is an error of that response alone.
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
