"""A rollout's rewards: one scorer, `RolloutScorer`, over a list of typed sources, each with a
name (its key in the reward breakdown and its metrics, ``reward/<name>``), a weight and a timeout.

    source              what it scores                                  where it runs
    RewardFunctions     functions, group functions and the reward       the reward actor (the app),
                        server (`forge.rewards.scorer.RewardScorer`)    or this process
    RewardModel         a classifier's or a judge's score               a service per model (the
                        (`forge.rewards.judge` for a judge's answers)   app), or this process
    EnvironmentReward   the environment's step rewards (``env``)        the trajectory
    AgentReward         what an agent program returned (``agent``)      the trajectory

Each trajectory's total is its sources' weighted values, summed source by source; an agent's
returned reward replaces the total (and the breakdown), as it is the episode's whole reward.
Every total is recorded in ``<metric_prefix>/total``. The app's rollout step, the eval (its
reward function as the one source, under ``eval/reward``) and the serial recipe all score with
a `RolloutScorer`.

Failures, one policy (`forge.rewards.failures`), applied here for every source: a call that
fails scores ``error_reward`` for the responses it scored and counts once, in
``reward/<name>/errors`` or ``/timeouts``. A source gives a `Failure` in place of the values of
each call that failed (a reward function that raised, hung or ended its process, in the worker
that saw it; a reward server's batch that failed for good; a reward model's call, or a value of
it that is no finite number). `RolloutScorer.counts`: every source's failures since the start,
which explain a starving trainer (`forge.runs.guards`).

Why the scorer runs on the controller and not in the reward actor: the reward models are
services, and a service's handle lives on the controller, which replaces its replicas from its
own event loop; a `Service` cannot be handed to another actor (`forge.actors.reward_models`).
So the scorer calls the reward models from there, and the reward actor for the functions.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from forge.data.types import Completion
from forge.observability import Reduce, record_metric
from forge.rewards.failures import Failure, RewardFailures
from forge.rewards.judge import judge_question
from forge.rewards.remote import REMOTE

if TYPE_CHECKING:
    from forge.actors.reward import RewardConfig, RewardModelConfig
    from forge.rewards.scorer import RewardScorer

# A trajectory's reward: (total, {source name: value}, {judge name: its answer}).
TrajectoryScore = tuple[float, dict[str, float], dict[str, str]]
# (prompts, responses, targets) of several groups -> {function name: value or Failure} of each
# response of each group: the reward actor's `evaluate_groups`, or `RewardScorer.score_groups`.
ScoreFunctions = Callable[
    [list[list[str]], list[list[str]], list[str]], Awaitable[list[list[dict[str, float | Failure]]]]
]


@dataclass
class Responses:
    """What the sources score: a rollout's trajectories, group by group, one target per group.
    Reward functions and models read each one's ``final_answer``: the conversation before the
    model's last turn (a one-turn trajectory: its prompt, as written or as the template rendered
    it) and that turn."""

    groups: list[list[Completion]]
    targets: list[str]

    @property
    def completions(self) -> list[Completion]:
        return [c for group in self.groups for c in group]

    @property
    def prompts(self) -> list[list[str]]:
        return [[c.final_answer[0] for c in group] for group in self.groups]

    @property
    def answers(self) -> list[list[str]]:
        return [[c.final_answer[1] for c in group] for group in self.groups]

    @property
    def flat_targets(self) -> list[str]:
        return [t for group, t in zip(self.groups, self.targets, strict=True) for _ in group]


@dataclass
class SourceScores:
    """A source's values for every response of the rollout, in order, by breakdown name: a number,
    or the `Failure` of the call that scored it (one object for all the responses of that call);
    a judge's answers by its name."""

    values: dict[str, list[float | Failure]]
    notes: dict[str, list[str]] = field(default_factory=dict)


class RewardSource(Protocol):
    weights: dict[str, float]  # its breakdown names, in order, and their weights
    timeout_s: float | None  # longest a call may take (None: no call, or no limit)
    # Whether the scorer records its values in <metric_prefix>/<name> (the environment's step
    # rewards are no metric).
    recorded: bool

    async def score(self, responses: Responses) -> SourceScores: ...


@dataclass
class RewardFunctions:
    """Reward functions, group functions and the reward server, in one call for the whole rollout
    (`score_functions`: the reward actor's `evaluate_groups`, or a `RewardScorer`'s in this
    process), weighed by `weights` (the reward server's under ``remote``); each call of a function
    within `timeout_s`."""

    score_functions: ScoreFunctions
    weights: dict[str, float]
    timeout_s: float | None = None
    recorded = True

    @classmethod
    def of(cls, cfg: RewardConfig, score_functions: ScoreFunctions) -> RewardFunctions:
        """The functions (and reward server) of `cfg` (``reward``), scored by `score_functions`."""
        weights = {f.name: f.weight for f in cfg.functions}
        if cfg.remote is not None:
            weights[REMOTE] = cfg.remote.weight
        return cls(score_functions, weights, cfg.timeout_s)

    @classmethod
    def in_process(cls, scorer: RewardScorer) -> RewardFunctions:
        """A `RewardScorer` of this process, scoring in a thread (it waits on its worker: about two
        ``timeout_s`` at most when calls hang), so that this process's event loop goes on."""

        async def score_functions(prompts, responses, targets):
            return await asyncio.to_thread(scorer.score_groups, prompts, responses, targets)

        return cls(score_functions, scorer.weights, scorer.timeout_s)

    async def score(self, responses: Responses) -> SourceScores:
        scored = await self.score_functions(responses.prompts, responses.answers, responses.targets)
        flat = [breakdown for group in scored for breakdown in group]
        return SourceScores({name: [breakdown[name] for breakdown in flat] for name in self.weights})


class ModelClient(Protocol):
    """How one reward model is called: `classify` for a classifier, `answer` for a judge. A call
    that missed its deadline raises `TimeoutError`."""

    async def classify(self, prompts: list[str], responses: list[str]) -> list[float]: ...
    async def answer(self, questions: list[str]) -> list[str]: ...


class RewardModel:
    """A classifier or a generative judge (`config`), reached through `client`: an actor service
    in the app (`forge.actors.reward_models`), an engine in this process in the serial recipe
    (`forge.recipes.reward_models`). A rollout's responses go out in calls of `batch_size`, all
    at once; each call is counted in ``reward/<name>/calls``. A judge's answers are kept, so that
    the rollout records show why a response scored what it did."""

    recorded = True

    def __init__(self, config: RewardModelConfig, client: ModelClient):
        self.config, self.client = config, client
        self.weights = {config.name: config.weight}
        self.timeout_s = config.timeout_s

    async def score(self, responses: Responses) -> SourceScores:
        m = self.config
        prompts = [p for group in responses.prompts for p in group]
        answers = [a for group in responses.answers for a in group]
        targets = responses.flat_targets
        batches = [slice(i, i + m.batch_size) for i in range(0, len(answers), m.batch_size)]
        parts = await asyncio.gather(*(self._call(prompts[b], answers[b], targets[b]) for b in batches))
        values = [v for part_values, _ in parts for v in part_values]
        if m.kind == "classifier":
            return SourceScores({m.name: values})
        return SourceScores({m.name: values}, {m.name: [n for _, notes in parts for n in notes]})

    async def _call(self, prompts, responses, targets) -> tuple[list[float | Failure], list[str]]:
        m = self.config
        record_metric(f"reward/{m.name}/calls", 1, Reduce.SUM)
        texts = None
        try:
            if m.kind == "classifier":
                values = await self.client.classify(prompts, responses)
            else:
                questions = [
                    judge_question(m.template, *item)
                    for item in zip(prompts, responses, targets, strict=True)
                ]
                texts = await self.client.answer(questions)
                values = [m.parse.score(text) for text in texts]
        except TimeoutError as e:
            return self._failed("timeouts", e, len(responses))
        # Every replica it tried died or hung, or the model itself raised.
        except Exception as e:
            return self._failed("errors", e, len(responses))
        scored: list[float | Failure] = []
        for i, value in enumerate(values):
            if value is not None and math.isfinite(value):
                scored.append(value)
            elif texts is None:
                scored.append(
                    Failure("errors", f"reward model '{m.name}' scored {value} on {responses[i][:200]!r}")
                )
            else:
                why = f"answered {texts[i][:200]!r}, which parse.regex {m.parse.regex!r} does not match"
                scored.append(Failure("errors", f"reward model '{m.name}' {why}"))
        return scored, texts or []

    def _failed(self, kind, error: BaseException, size: int) -> tuple[list[Failure], list[str]]:
        m = self.config
        why = f"failed on a call of {size} responses: {error}".splitlines()[0]
        failure = Failure(kind, f"reward model '{m.name}' {why}")
        return [failure] * size, [f"(no answer: {type(error).__name__})"] * size


class EnvironmentReward:
    """The sum of each trajectory's step rewards from its environment (``env``, weight 1): a
    source where an environment or an agent takes turns, not in single-turn rollouts."""

    weights = {"env": 1.0}
    timeout_s = None
    recorded = False

    async def score(self, responses: Responses) -> SourceScores:
        return SourceScores({"env": [c.env_reward for c in responses.completions]})


class AgentReward:
    """What an agent program returned for its episode (``Completion.agent_reward``): the episode's
    whole reward, which replaces the other sources' total and breakdown (``agent``); None leaves
    them."""

    weights: dict[str, float] = {}
    timeout_s = None
    recorded = False

    async def score(self, responses: Responses) -> SourceScores:
        return SourceScores({})


class RolloutScorer:
    """Each trajectory's reward, over `sources` (see the module docstring); `error_reward` is what
    a response scores from a call that failed."""

    def __init__(self, sources: list[RewardSource], error_reward: float = 0.0, metric_prefix: str = "reward"):
        self.sources, self.metric_prefix = sources, metric_prefix
        self.failures = RewardFailures(error_reward, metric_prefix)
        self._agent = any(isinstance(s, AgentReward) for s in sources)

    @classmethod
    def for_run(
        cls,
        cfg: RewardConfig,
        functions: RewardFunctions,
        models: list[ModelClient],
        environment: bool = False,
        agent: bool = False,
    ) -> RolloutScorer:
        """A GRPO run's scorer: its reward functions, its reward models (`models`: a client per
        model of ``reward.models``, in order), the environment's step rewards where an
        `environment` or an `agent` takes turns, and an `agent`'s returned reward."""
        sources: list[RewardSource] = [functions]
        sources += [RewardModel(m, client) for m, client in zip(cfg.models, models, strict=True)]
        if environment or agent:
            sources.append(EnvironmentReward())
        if agent:
            sources.append(AgentReward())
        return cls(sources, cfg.error_reward)

    @property
    def counts(self) -> dict[str, int]:
        """Every source's failed calls since the start: {"errors": n, "timeouts": n}."""
        return self.failures.counts

    async def score(self, groups: list[list[Completion]], targets: list[str]) -> list[list[TrajectoryScore]]:
        """Each trajectory's (total, breakdown, notes), group by group (one target per group):
        every source's calls for the whole rollout, at once."""
        responses = Responses(groups, targets)
        scored = await asyncio.gather(*(source.score(responses) for source in self.sources))
        values = [
            {name: self._values(source, name, scores.values[name]) for name in source.weights}
            for source, scores in zip(self.sources, scored, strict=True)
        ]
        flat = []
        for i, completion in enumerate(responses.completions):
            total, breakdown, notes = 0.0, {}, {}
            for source, source_values, scores in zip(self.sources, values, scored, strict=True):
                for name, weight in source.weights.items():
                    breakdown[name] = source_values[name][i]
                    total += weight * breakdown[name]
                notes.update({name: answers[i] for name, answers in scores.notes.items()})
            if self._agent and completion.agent_reward is not None:
                total, breakdown = completion.agent_reward, {"agent": completion.agent_reward}
            record_metric(f"{self.metric_prefix}/total", total, Reduce.MEAN)
            flat.append((total, breakdown, notes))
        trajectories = iter(flat)
        return [[next(trajectories) for _ in group] for group in groups]

    def _values(self, source: RewardSource, name: str, values: list[float | Failure]) -> list[float]:
        """`values` with `error_reward` for each failure, each failed call counted once; recorded
        in <metric_prefix>/<name> where the source's values are."""
        sizes: dict[int, int] = {}
        for value in values:
            if isinstance(value, Failure):
                sizes[id(value)] = sizes.get(id(value), 0) + 1
        out = []
        for value in values:
            if isinstance(value, Failure):
                if (size := sizes.pop(id(value), None)) is not None:
                    self.failures.failed(name, value.kind, value.why, size)
                value = self.failures.error_reward
            if source.recorded:
                record_metric(f"{self.metric_prefix}/{name}", value, Reduce.MEAN)
            out.append(value)
        return out
