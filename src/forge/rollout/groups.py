"""Multi-turn rollouts, token in and token out: dataset rows -> groups of trajectories.

    rows ──reset──> opening messages ──chat template──> prompt ids
      turn 1: one generate call, `group_size` samples of each prompt
      then, while a trajectory goes on (the environment is not done, no limit reached):
        its last turn's text ──step──> reward, done, the environment's messages
        messages ──chat template──> ids appended (mask 0)
        turn k: one generate call for every trajectory still going, continuing from its ids

Every generate call batches the turns of all trajectories that are still going, so both
engines see as large a batch as there is. The model's tokens keep their sampled ids, logprobs
and policy version; nothing is re-tokenized (``forge.envs.turns``).

Single-turn GRPO is this code with the built-in ``OneTurn`` environment (the default): it opens
with the row's prompt as it is and ends every trajectory after the model's first turn, with no
reward, so its completions are exactly the ones the generator returned.

Limits: ``max_turns`` model turns, and a budget of ``max_tokens`` for the whole sequence
(prompt and every turn; the trainer's ``seq_len``). A trajectory stopped by a limit while its
environment would go on is marked ``truncated``; an opening prompt that fills the budget stops
the run, naming the row (its ``origin``, `forge.data.prompts.with_origins`): only rollouts see
what ``reset`` opens with. Sampling is seeded per trajectory: turn 1 by
the row's sample key and the sample's index (as single-turn GRPO), later turns by
``sample_seed(key, index, turn)``.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from forge.data.chat_prompts import RenderedPrompt
from forge.data.types import Completion
from forge.engines.generation import sample_seed
from forge.envs.base import EnvStep
from forge.envs.sessions import EnvFailure, Opening
from forge.envs.turns import TurnRenderer
from forge.observability import Reduce, record_metric
from forge.rollout.trajectories import Trajectory
from forge.runs.errors import RunStopped

# generate(prompt_ids, sample_keys, n=..., max_tokens=..., **sampling) -> n completions per prompt
Generate = Callable[..., Awaitable[list[list[Completion]]]]


class EnvSessions(Protocol):
    """Environments keyed by trajectory id (``OneTurn``, ``LocalEnvironments``, or an actor's
    endpoints)."""

    async def reset(self, ids: list[str], rows: list[dict]) -> list[Opening | EnvFailure]: ...
    async def step(self, ids: list[str], texts: list[str]) -> list[EnvStep | EnvFailure]: ...
    async def close(self, ids: list[str]) -> None: ...


class OneTurn:
    """The environment of single-turn GRPO (no ``env`` configured): the row's prompt as it is,
    and one model turn, which ends the trajectory with no reward. Its trajectories become plain
    completions (no turns or mask: see ``Trajectory.to_completion``)."""

    async def reset(self, ids: list[str], rows: list[dict]) -> list[Opening | EnvFailure]:
        return [Opening(row["prompt"], None) for row in rows]

    async def step(self, ids: list[str], texts: list[str]) -> list[EnvStep | EnvFailure]:
        return [EnvStep(done=True) for _ in ids]

    async def close(self, ids: list[str]) -> None:
        pass


@dataclass(frozen=True)
class TrajectoryLimits:
    max_turns: int = 1
    max_tokens: int | None = None  # prompt + all turns; None: no budget


async def run_groups(
    rows: Sequence[dict],
    sample_keys: Sequence[int] | None,
    *,
    group_size: int,
    generate: Generate,
    renderer: TurnRenderer,
    max_tokens: int,
    envs: EnvSessions = OneTurn(),
    limits: TrajectoryLimits = TrajectoryLimits(),
    **sampling: Any,
) -> list[list[Completion] | None]:
    """``group_size`` trajectories per row, as completions; None for a group whose environment
    failed (counted in ``rollout/env_failures``). ``max_tokens`` bounds each model turn;
    ``sampling`` overrides the generator's other sampling settings (e.g. temperature)."""
    ids = [[f"{uuid.uuid4().hex}-{j}" for j in range(group_size)] for _ in rows]
    flat_ids = [i for group in ids for i in group]
    try:
        prompts = await _openings(rows, ids, group_size, renderer, envs, limits)
        groups = await _first_turn(prompts, sample_keys, group_size, generate, max_tokens, limits, sampling)
        by_id = {
            i: t
            for group_ids, group in zip(ids, groups, strict=True)
            if group
            for i, t in zip(group_ids, group, strict=True)
        }
        await _continue(by_id, sample_keys, ids, generate, renderer, envs, max_tokens, limits, sampling)
    finally:
        await envs.close(flat_ids)
    return _completions(groups, renderer.tokenizer, single_turn=isinstance(envs, OneTurn))


async def _openings(rows, ids, group_size, renderer, envs, limits) -> list[RenderedPrompt | None]:
    """Each row's prompt: the environment's opening, rendered (None: reset failed)."""
    flat_rows = [row for row in rows for _ in range(group_size)]
    openings = await envs.reset([i for group in ids for i in group], flat_rows)
    prompts = []
    for g in range(len(rows)):
        group = openings[g * group_size : (g + 1) * group_size]
        if any(isinstance(o, EnvFailure) for o in group):
            record_metric("rollout/env_failures", 1, Reduce.SUM)
            prompts.append(None)
            continue
        if any((o.messages, o.tools) != (group[0].messages, group[0].tools) for o in group):
            raise ValueError(
                "env.reset() opened the trajectories of one dataset row with different messages: "
                "GRPO compares samples of one prompt, so reset must depend on the row only"
            )
        prompts.append(renderer.prompts.render(group[0].messages, group[0].tools))
    for row, prompt in zip(rows, prompts, strict=True):
        if prompt is not None and limits.max_tokens is not None and len(prompt.ids) >= limits.max_tokens:
            # Every trajectory of this row would be cut before its first token: a stop, not a
            # failed group (the row comes again each epoch).
            raise RunStopped(
                f"{row.get('origin', 'a dataset row')}: its opening prompt (env.reset) is {len(prompt.ids)} "
                f"tokens, which leaves no room in the trajectory's budget of {limits.max_tokens} tokens: "
                "raise env.max_tokens (at most trainer.engine.training.seq_len, its default), or shorten "
                "or remove that row"
            )
    return prompts


def _turn_budget(trajectories: Sequence[Trajectory], max_tokens: int, limits: TrajectoryLimits) -> int:
    """One generate call has one max_tokens: the most any of its trajectories may still take
    (each is cut to its own budget afterwards, which changes no kept token)."""
    if limits.max_tokens is None:
        return max_tokens
    return min(max_tokens, max(limits.max_tokens - len(t.ids) for t in trajectories))


def _fit(trajectory: Trajectory, limits: TrajectoryLimits) -> None:
    if limits.max_tokens is not None and len(trajectory.ids) > limits.max_tokens:
        trajectory.cut(limits.max_tokens)


async def _first_turn(prompts, sample_keys, group_size, generate, max_tokens, limits, sampling):
    live = [g for g, p in enumerate(prompts) if p is not None]
    groups: list[list[Trajectory] | None] = [None] * len(prompts)
    if not live:
        return groups
    starts = [Trajectory(prompts[g]) for g in live]
    outputs = await generate(
        [prompts[g].ids for g in live],
        [sample_keys[g] for g in live] if sample_keys is not None else None,
        n=group_size,
        max_tokens=_turn_budget(starts, max_tokens, limits),
        **sampling,
    )
    for g, samples in zip(live, outputs, strict=True):
        groups[g] = []
        for sample in samples:
            trajectory = Trajectory(prompts[g])
            trajectory.add_model_turn(sample)
            _fit(trajectory, limits)
            groups[g].append(trajectory)
    return groups


async def _continue(by_id, sample_keys, ids, generate, renderer, envs, max_tokens, limits, sampling):
    """Environment turns and model turns alternate until every trajectory is done."""
    keys = {}  # trajectory id -> (row's sample key, sample index), for seeding later turns
    if sample_keys is not None:
        keys = {i: (key, j) for key, group in zip(sample_keys, ids, strict=True) for j, i in enumerate(group)}
    while going := [i for i, t in by_id.items() if not t.done]:
        steps = await envs.step(going, [by_id[i].last_model_text for i in going])
        for i, step in zip(going, steps, strict=True):
            _apply_step(by_id[i], step, renderer, limits)
        going = [i for i in going if not by_id[i].done]
        if not going:
            break
        turn = by_id[going[0]].model_turns + 1
        outputs = await generate(
            [by_id[i].ids for i in going],
            [sample_seed(*keys[i], turn) for i in going] if keys else None,
            n=1,
            max_tokens=_turn_budget([by_id[i] for i in going], max_tokens, limits),
            **sampling,
        )
        for i, [sample] in zip(going, outputs, strict=True):
            by_id[i].add_model_turn(sample)
            _fit(by_id[i], limits)


def _apply_step(trajectory: Trajectory, step, renderer: TurnRenderer, limits: TrajectoryLimits) -> None:
    if isinstance(step, EnvFailure):
        trajectory.error, trajectory.done = step.message, True
        return
    trajectory.reward_last_turn(step.reward)
    if step.done:
        trajectory.done = True
    elif trajectory.model_turns >= limits.max_turns:
        trajectory.truncated = trajectory.done = True
    else:
        last_turn = trajectory.response_ids[-trajectory.turns[-1].num_tokens :]
        role = step.messages[0]["role"] if step.messages else "environment"
        trajectory.add_environment_turn(role, renderer.environment_ids(step.messages, last_turn))
        if limits.max_tokens is not None and len(trajectory.ids) >= limits.max_tokens:
            trajectory.cut(limits.max_tokens)
            trajectory.truncated = trajectory.done = True


def _completions(groups, tokenizer, single_turn: bool) -> list[list[Completion] | None]:
    out = []
    for group in groups:
        if group is None or any(t.error for t in group):
            if group is not None:
                record_metric("rollout/env_failures", 1, Reduce.SUM)
            out.append(None)
            continue
        out.append([t.to_completion(tokenizer, single_turn) for t in group])
        if not single_turn:
            for t in group:
                record_metric("rollout/turns", t.model_turns, Reduce.MEAN)
                record_metric("rollout/truncated", int(t.truncated), Reduce.SUM)
    return out
