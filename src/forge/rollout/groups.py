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
reward, so its completions are the ones the generator returned, each as its one turn.

Limits: ``max_turns`` model turns, and a budget of ``max_tokens`` for the whole sequence
(prompt and every turn; the trainer's ``seq_len``). A trajectory stopped by a limit while its
environment would go on is marked ``truncated``; an opening prompt that fills the budget stops
the run, naming the row (its ``origin``, `forge.data.prompts.with_origins`): only rollouts see
what ``reset`` opens with (an environment that opens with the row's prompt as it is is measured
before the run starts, `forge.runs.checks`). Sampling is seeded per trajectory: turn 1 by
the row's sample key and the sample's index (as single-turn GRPO), later turns by
``sample_seed(key, index, turn)``.

Failures: an environment call that fails (``EnvFailure``: it raised, missed its deadline, or
its environment was lost with a replica) ends its trajectory. Once every trajectory is done,
the failed ones are rerun from ``reset`` (``retries`` times at most; fresh trajectory ids, the
first turn sampled with n=1 per rerun, each from a random stream of its own), so that a flaky
tool costs an episode, not a group; a trajectory that fails every time drops its group. The
environments of a failed attempt are closed before the rerun, and every other one at the end,
also when the rollout is cancelled (each call has a deadline). Failures are counted and logged
by ``forge.rollout.env_failures``.
"""

from __future__ import annotations

import contextlib
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
from forge.rollout.env_failures import EnvFailures
from forge.rollout.trajectories import Trajectory
from forge.runs.errors import RunStopped

# generate(prompt_ids, sample_keys, n=..., max_tokens=..., **sampling) -> n completions per prompt
Generate = Callable[..., Awaitable[list[list[Completion]]]]


class EnvSessions(Protocol):
    """Environments keyed by trajectory id (``OneTurn``, ``LocalEnvironments``, or an actor's
    endpoints)."""

    async def reset(self, ids: list[str], rows: list[dict]) -> list[Opening | EnvFailure]: ...
    async def step(self, ids: list[str], texts: list[str]) -> list[EnvStep | EnvFailure]: ...
    async def close(self, ids: list[str]) -> list[EnvFailure]: ...


class OneTurn:
    """The environment of single-turn GRPO (no ``env`` configured): the row's prompt as it is,
    and one model turn, which ends the trajectory with no reward: its completions have one model
    turn, as the generator sampled it."""

    async def reset(self, ids: list[str], rows: list[dict]) -> list[Opening | EnvFailure]:
        return [Opening(row["prompt"], None) for row in rows]

    async def step(self, ids: list[str], texts: list[str]) -> list[EnvStep | EnvFailure]:
        return [EnvStep(done=True) for _ in ids]

    async def close(self, ids: list[str]) -> list[EnvFailure]:
        return []

    def session(self):
        """As an environment service's session (`forge.actors.environment.ActorEnvironments`):
        here nothing is kept on a replica."""
        return contextlib.nullcontext()


@dataclass(frozen=True)
class TrajectoryLimits:
    max_turns: int = 1
    max_tokens: int | None = None  # prompt + all turns; None: no budget
    retries: int = 0  # reruns of a trajectory whose environment failed (env.retries)


Slot = tuple[int, int]  # (group, sample): the place of a trajectory in the groups


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
    failures: EnvFailures | None = None,
    **sampling: Any,
) -> list[list[Completion] | None]:
    """``group_size`` trajectories per row, as completions; None for a group that lost a
    trajectory to its environment after ``limits.retries`` reruns (counted in
    ``rollout/env_failures``). ``max_tokens`` bounds each model turn; ``sampling`` overrides
    the generator's other sampling settings (e.g. temperature). ``failures`` counts and logs the
    environment's failures (None: a new one, for this call only)."""
    failures = failures if failures is not None else EnvFailures()
    run = _Run(rows, sample_keys, group_size, generate, renderer, envs, max_tokens, limits, sampling)
    slots = [(g, j) for g in range(len(rows)) for j in range(group_size)]
    try:
        for attempt in range(limits.retries + 1):
            if attempt:
                await run.close([run.ids[s] for s in slots])  # the failed attempt's environments
                failures.retried(len(slots))
            await run.attempt(slots, attempt)
            if not (slots := run.failed(slots)):
                break
    finally:
        await run.close(list(run.open))
        failures.report(run.seen)
    groups = [None if any(t is None or t.error for t in group) else group for group in run.trajectories]
    if dropped := sum(group is None for group in groups):
        failures.dropped(dropped)
    return _completions(groups, renderer.tokenizer, environment=not isinstance(envs, OneTurn))


class _Run:
    """The trajectories of one ``run_groups`` call, attempt by attempt. Attempt 0 opens every
    slot and samples each row's first turns in one call (``group_size`` samples of its prompt,
    sample j seeded by the row's key and j); a rerun opens only the slots that failed, each
    with a fresh trajectory id and a random stream of its own (``sample_seed(key, j,
    -attempt)``: later turns use positive numbers)."""

    def __init__(self, rows, sample_keys, group_size, generate, renderer, envs, max_tokens, limits, sampling):
        self.rows, self.sample_keys, self.group_size = rows, sample_keys, group_size
        self.generate, self.renderer, self.envs = generate, renderer, envs
        self.max_tokens, self.limits, self.sampling = max_tokens, limits, sampling
        self.trajectories: list[list[Trajectory | None]] = [[None] * group_size for _ in rows]
        self.ids: dict[Slot, str] = {}  # each slot's latest trajectory id
        self.open: set[str] = set()  # ids reset and not closed yet
        self.seen: list[EnvFailure] = []  # every failure of the environment, for the log
        self._openings: list[Opening | None] = [None] * len(rows)  # each row's first opening
        self._prompts: list[RenderedPrompt | None] = [None] * len(rows)

    async def attempt(self, slots: list[Slot], attempt: int) -> None:
        for g, j in slots:
            self.ids[g, j] = f"{uuid.uuid4().hex}-{j}"
            self.trajectories[g][j] = None
        ids = [self.ids[s] for s in slots]
        self.open.update(ids)
        openings = await self.envs.reset(ids, [self.rows[g] for g, _ in slots])
        opened = [s for s, o in zip(slots, openings, strict=True) if self._opened(s, o)]
        streams = await self._first_turn(opened, attempt)
        by_id = {self.ids[g, j]: self.trajectories[g][j] for g, j in opened}
        await self._continue(by_id, {self.ids[s]: streams[s] for s in opened} if streams else None)

    def failed(self, slots: list[Slot]) -> list[Slot]:
        return [(g, j) for g, j in slots if (t := self.trajectories[g][j]) is None or t.error]

    async def close(self, ids: list[str]) -> None:
        self.open.difference_update(ids)
        if ids:
            self.seen += await self.envs.close(ids)

    def _opened(self, slot: Slot, opening: Opening | EnvFailure) -> bool:
        """Whether the slot's environment opened; the first opening of a row is its prompt."""
        g, _ = slot
        if isinstance(opening, EnvFailure):
            self.seen.append(opening)
            return False
        first = self._openings[g]
        if first is None:
            self._openings[g] = opening
            self._prompts[g] = self._render(self.rows[g], opening)
        elif (opening.messages, opening.tools) != (first.messages, first.tools):
            raise ValueError(
                "env.reset() opened the trajectories of one dataset row with different messages: "
                "GRPO compares samples of one prompt, so reset must depend on the row only"
            )
        return True

    def _render(self, row: dict, opening: Opening) -> RenderedPrompt:
        prompt = self.renderer.prompts.render(opening.messages, opening.tools)
        if self.limits.max_tokens is not None and len(prompt.ids) >= self.limits.max_tokens:
            # Every trajectory of this row would be cut before its first token: a stop, not a
            # failed group (the row comes again each epoch).
            raise RunStopped(
                f"{row.get('origin', 'a dataset row')}: its opening prompt (env.reset) is {len(prompt.ids)} "
                f"tokens, which leaves no room in the trajectory's budget of {self.limits.max_tokens} tokens: "
                "raise env.max_tokens (at most trainer.engine.training.seq_len, its default), or shorten "
                "or remove that row"
            )
        return prompt

    async def _first_turn(self, opened: list[Slot], attempt: int) -> dict[Slot, tuple[int, int]] | None:
        """Samples the first turn of the opened slots; returns each one's random stream (the key
        and sample index that seed its later turns; None: unseeded)."""
        seeded = self.sample_keys is not None
        if attempt == 0:
            # One call, group_size samples of the prompt of each row with a slot opened; the
            # samples of the slots that did not open go unused (those slots are rerun).
            streams = {(g, j): (self.sample_keys[g], j) for g, j in opened} if seeded else None
            rows = sorted({g for g, _ in opened})
            keys = [self.sample_keys[g] for g in rows] if seeded else None
            outputs = await self._sample([Trajectory(self._prompts[g]) for g in rows], keys, self.group_size)
            by_row = dict(zip(rows, outputs, strict=True))
            samples = [by_row[g][j] for g, j in opened]
        else:
            # One sample of each rerun slot's prompt, from the slot's own stream.
            streams = None
            if seeded:
                streams = {(g, j): (sample_seed(self.sample_keys[g], j, -attempt), 0) for g, j in opened}
            keys = [streams[s][0] for s in opened] if seeded else None
            outputs = await self._sample([Trajectory(self._prompts[g]) for g, _ in opened], keys, 1)
            samples = [sample for [sample] in outputs]
        for (g, j), sample in zip(opened, samples, strict=True):
            trajectory = self.trajectories[g][j] = Trajectory(self._prompts[g])
            trajectory.add_model_turn(sample)
            _fit(trajectory, self.limits)
        return streams

    async def _sample(self, trajectories: list[Trajectory], keys: list[int] | None, n: int):
        """`n` samples continuing each trajectory, in one generate call."""
        if not trajectories:
            return []
        return await self.generate(
            [t.ids for t in trajectories],
            keys,
            n=n,
            max_tokens=_turn_budget(trajectories, self.max_tokens, self.limits),
            **self.sampling,
        )

    async def _continue(self, by_id: dict[str, Trajectory], streams: dict[str, tuple[int, int]] | None):
        """Environment turns and model turns alternate until every trajectory is done."""
        while going := [i for i, t in by_id.items() if not t.done]:
            steps = await self.envs.step(going, [by_id[i].last_model_text for i in going])
            for i, step in zip(going, steps, strict=True):
                if isinstance(step, EnvFailure):
                    self.seen.append(step)
                _apply_step(by_id[i], step, self.renderer, self.limits)
            going = [i for i in going if not by_id[i].done]
            if not going:
                break
            turn = by_id[going[0]].model_turns + 1
            keys = [sample_seed(*streams[i], turn) for i in going] if streams is not None else None
            outputs = await self._sample([by_id[i] for i in going], keys, 1)
            for i, [sample] in zip(going, outputs, strict=True):
                by_id[i].add_model_turn(sample)
                _fit(by_id[i], self.limits)


def _turn_budget(trajectories: Sequence[Trajectory], max_tokens: int, limits: TrajectoryLimits) -> int:
    """One generate call has one max_tokens: the most any of its trajectories may still take
    (each is cut to its own budget afterwards, which changes no kept token)."""
    if limits.max_tokens is None:
        return max_tokens
    return min(max_tokens, max(limits.max_tokens - len(t.ids) for t in trajectories))


def _fit(trajectory: Trajectory, limits: TrajectoryLimits) -> None:
    if limits.max_tokens is not None and len(trajectory.ids) > limits.max_tokens:
        trajectory.cut(limits.max_tokens)


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


def _completions(groups, tokenizer, environment: bool) -> list[list[Completion] | None]:
    """The trajectories as completions; with an `environment` (not ``OneTurn``), each one's turns
    and truncation recorded in ``rollout/turns`` and ``rollout/truncated``."""
    out = []
    for group in groups:
        if group is None:
            out.append(None)
            continue
        out.append([t.to_completion(tokenizer) for t in group])
        if environment:
            for t in group:
                record_metric("rollout/turns", t.model_turns, Reduce.MEAN)
                record_metric("rollout/truncated", int(t.truncated), Reduce.SUM)
    return out
