"""A rollout's rewards, summed for each trajectory from every source: the reward functions and the
reward server (one batch call: the reward actor's, or a `RewardScorer`'s in this process), the
reward models (`forge.rewards.models`, weighed into the total, their breakdown keyed by name) and
the environment's step rewards (``env``: a source of rollouts where an environment or an agent
took turns). The app's rollout step and the serial recipe both score with `score_trajectories`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from forge.data.types import Completion
from forge.observability import Reduce, record_metric
from forge.rewards.models import RewardModels

# (prompts, responses, targets) of several groups -> (weighted total, {function name: value}) of
# each response of each group.
ScoreFunctions = Callable[
    [list[list[str]], list[list[str]], list[str]], Awaitable[list[list[tuple[float, dict[str, float]]]]]
]
# A trajectory's reward: (total, {source name: value}, {judge name: its answer}).
TrajectoryScore = tuple[float, dict[str, float], dict[str, str]]


def score_inputs(group: list[Completion]) -> tuple[list[str], list[str]]:
    """What reward functions score for each completion: (context, the model's last turn)."""
    pairs = [c.final_answer for c in group]
    return [context for context, _ in pairs], [answer for _, answer in pairs]


def with_env_reward(completion: Completion, total: float, breakdown: dict[str, float], env_reward: bool):
    """A trajectory's reward: the other sources' total plus, with `env_reward`, its environment's
    step rewards; or the reward its agent program returned, alone."""
    if completion.agent_reward is not None:
        return completion.agent_reward, {"agent": completion.agent_reward}
    if not env_reward:
        return total, breakdown
    return total + completion.env_reward, {**breakdown, "env": completion.env_reward}


async def score_trajectories(
    groups: list[list[Completion]],
    targets: list[str],
    score_functions: ScoreFunctions,
    reward_models: RewardModels | None = None,
    env_reward: bool = False,
) -> list[list[TrajectoryScore]]:
    """Each trajectory's reward, group by group (one target per group): the functions' call and
    the reward models' calls for the whole rollout, at once; with `env_reward` (an environment or
    an agent took turns), the environment's step rewards too. The totals, over every source, are
    recorded in ``reward/total``."""
    # Reward functions take the prompt as a string: `Completion.prompt`, a string prompt as
    # written, chat messages as the chat template rendered them; after several turns, the
    # conversation before the model's last turn, which is the response they score.
    inputs = [score_inputs(g) for g in groups]
    prompts, answers = [p for p, _ in inputs], [a for _, a in inputs]
    scores, model_scores = await asyncio.gather(
        score_functions(prompts, answers, targets),
        score_with_models(reward_models, prompts, answers, targets),
    )
    models_total = reward_models.weighted_total if reward_models is not None else lambda values: 0.0
    scored = [
        [
            (*with_env_reward(c, total + models_total(values), {**breakdown, **values}, env_reward), notes)
            for c, (total, breakdown), (values, notes) in zip(group, group_scores, group_models, strict=True)
        ]
        for group, group_scores, group_models in zip(groups, scores, model_scores, strict=True)
    ]
    for total, *_ in (score for group in scored for score in group):
        record_metric("reward/total", total, Reduce.MEAN)
    return scored


async def score_with_models(
    reward_models: RewardModels | None,
    prompts: list[list[str]],
    answers: list[list[str]],
    targets: list[str],
) -> list[list[tuple[dict[str, float], dict[str, str]]]]:
    """({model name: value}, {judge name: its answer}) of each response of each group, from the
    reward models' calls for the whole rollout; empty dicts without reward models."""
    sizes = [len(group) for group in answers]
    if reward_models is None or not reward_models.models:
        return [[({}, {}) for _ in range(size)] for size in sizes]
    flat = await reward_models.score(
        [p for group in prompts for p in group],
        [a for group in answers for a in group],
        [t for t, size in zip(targets, sizes, strict=True) for _ in range(size)],
    )
    per_response = [
        (
            {name: s.values[i] for name, s in flat.items()},
            {name: s.notes[i] for name, s in flat.items() if s.notes is not None},
        )
        for i in range(sum(sizes))
    ]
    responses = iter(per_response)
    return [[next(responses) for _ in range(size)] for size in sizes]
