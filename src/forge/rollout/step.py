"""One rollout step of GRPO-style training, over actor handles: prompts -> scored episodes.

Kept out of the app so that other recipes (and users' environments) can reuse it; every
call goes to one replica of an actor handle, lone actor or service (`route`), and the reference
model's is answered by all its ranks (`forge.actors.reference.reference_logprobs`). The
environment's failures are counted since the start in `Rollouts.env_failures`
(`forge.rollout.env_failures`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from forge.actors.critic import critic_values
from forge.actors.environment import ActorEnvironments
from forge.actors.reference import reference_logprobs
from forge.agents.rollout import AgentRollouts
from forge.controller.liveness import CallDeadline
from forge.controller.service import NoHealthyReplicaError, ReplicaFailedError
from forge.data.types import Completion, Episode
from forge.envs.turns import TurnRenderer
from forge.observability import Reduce, record_metric
from forge.rewards.sources import RolloutScorer
from forge.rl.advantage import has_signal
from forge.rollout.env_failures import EnvFailures
from forge.rollout.groups import EnvSessions, OneTurn, TrajectoryLimits, run_groups
from forge.rollout.records import RolloutRecorder
from forge.rollout.token_advantages import TokenAdvantages


@dataclass
class Rollouts:
    """How dataset rows become groups of trajectories (``forge.rollout.groups``): the generator
    (actor or service), the chat template, and the environments (the actors' service, or the
    built-in ``OneTurn``: one turn per prompt), or an agent program instead
    (``forge.agents.rollout``).
    ``max_tokens`` bounds each model turn (``generator.sampling.max_tokens``); each generate
    call must answer within ``deadline`` for the tokens it may sample."""

    generator: Any
    renderer: TurnRenderer
    max_tokens: int
    envs: ActorEnvironments | OneTurn = field(default_factory=OneTurn)
    limits: TrajectoryLimits = TrajectoryLimits()
    drop_truncated: bool = False
    deadline: CallDeadline = field(default_factory=CallDeadline)
    env_failures: EnvFailures = field(default_factory=EnvFailures)
    agent: AgentRollouts | None = None

    async def groups(
        self,
        rows: list[dict],
        sample_keys: list[int] | None,
        min_version: int,
        group_size: int,
        max_tokens: int | None = None,
        **sampling: Any,
    ) -> list[list[Completion] | None]:
        async def generate(prompt_ids, sample_keys, n: int, max_tokens: int, **sampling):
            seconds = self.deadline.seconds(len(prompt_ids) * n * max_tokens)
            return await self.generator.generate.route_within(
                seconds,
                prompt_ids,
                sample_keys,
                min_version=min_version,
                n=n,
                max_tokens=max_tokens,
                **sampling,
            )

        async def run(envs: EnvSessions):
            return await run_groups(
                rows,
                sample_keys,
                group_size=group_size,
                generate=generate,
                renderer=self.renderer,
                max_tokens=max_tokens or self.max_tokens,
                envs=envs,
                limits=self.limits,
                failures=self.env_failures,
                **sampling,
            )

        if self.agent is not None:
            max_tokens = max_tokens or self.max_tokens
            return await self.agent.groups(
                rows, sample_keys, group_size, generate, max_tokens, sampling.get("temperature")
            )
        # A rollout's trajectories stay on one environment replica: it holds their state.
        async with self.envs.session():
            return await run(self.envs)


async def score_groups(
    rows: list[dict], groups: list[list[Completion]], scorer: RolloutScorer, advantages
) -> list[list[Episode]]:
    """Rewards (`scorer`: the reward actor's functions and server, the reward models, the
    environment's), then group-relative advantages, for the completions of each prompt: the
    sources' calls at once, then one call to advantages (None: no group advantages, each episode's is
    0; its per-token ones come later, `forge.rollout.token_advantages`). An agent's episode split into several
    sequences is scored once, by its final one, and each sequence becomes an episode with that
    reward and advantage."""
    scores = await scorer.score(groups, [r["target"] for r in rows])
    totals = [[total for total, *_ in group] for group in scores]
    if advantages is None:
        values = [[0.0] * len(group) for group in totals]
    else:
        values = await advantages.compute_groups.route(totals)
    scored = []
    for row, group, group_scores, group_values in zip(rows, groups, scores, values, strict=True):
        group_id = uuid.uuid4().hex
        scored.append(
            [
                Episode(
                    sequence,
                    row["target"],
                    group_id,
                    reward=total,
                    reward_breakdown=breakdown,
                    reward_notes=notes,
                    advantage=adv,
                )
                for c, (total, breakdown, notes), adv in zip(group, group_scores, group_values, strict=True)
                for sequence in [*_taken_splits(c), c]
            ]
        )
    return scored


def _taken_splits(completion: Completion) -> list[Completion]:
    """The sequences an agent's episode was split into before `completion` (scored and
    advantaged as the episode, they train with it), taken off it."""
    splits, completion.split_sequences = completion.split_sequences or [], None
    return splits


def without_truncated(groups: list[list[Episode]]) -> list[list[Episode]]:
    """The groups without their truncated trajectories (`env.on_truncation: drop`), counted in
    `rollout/truncated_dropped`. Their advantages were computed with the whole group, so the
    others' are what they would have been; a group left empty is dropped."""
    kept = [[e for e in g if not e.completion.truncated] for g in groups]
    record_metric("rollout/truncated_dropped", sum(map(len, groups)) - sum(map(len, kept)), Reduce.SUM)
    return [g for g in kept if g]


async def add_token_scores(
    episodes: list[Episode], reference, teacher, token_advantages: TokenAdvantages | None, critic=None
) -> None:
    """Fills `ref_logprobs` of each episode from the reference model, and then its
    `token_advantages` (with the teacher's logprobs where there is a teacher, and the critic's
    values where there is a critic): the reference, the teacher and the critic each score all
    the episodes in one batched call, which their data-parallel ranks split, all at once."""
    completions = [e.completion for e in episodes]

    async def scores(model) -> list[list[float]] | None:
        return None if model is None else await reference_logprobs(model, completions)

    async def values() -> list[list[float]] | None:
        return None if critic is None else await critic_values(critic, completions)

    ref_rows, teacher_rows, value_rows = await asyncio.gather(scores(reference), scores(teacher), values())
    if ref_rows is not None:
        for episode, row in zip(episodes, ref_rows, strict=True):
            episode.ref_logprobs = row
    if token_advantages is not None:
        token_advantages.apply(episodes, teacher_rows, value_rows)


@dataclass
class RolloutCounts:
    """What the rollout loops did since the start, for messages that explain a run's state."""

    groups: int = 0
    groups_skipped: int = 0  # no signal: every reward of the group was equal
    groups_empty: int = 0  # of those, groups whose completions were all empty text
    groups_failed: int = 0  # lost with a generator or environment replica that died, or an env error
    waits_for_room: int = 0  # times a loop waited on a full buffer


async def wait_for_room(
    replay_buffer,
    counts: RolloutCounts | None = None,
    trainer_version: Callable[[], int] | None = None,
    poll_s: float = 0.05,
) -> None:
    """Waits while the buffer is full (backpressure), counting the wait in `rollout/wait_for_room_s`.
    `trainer_version()`, the version the next train step starts from, lets the buffer evict
    the episodes that step can no longer use before it counts."""
    started = time.perf_counter()
    waited = False
    while not await replay_buffer.has_room.route(trainer_version() if trainer_version else None):
        waited = True
        await asyncio.sleep(poll_s)
    if waited:
        record_metric("rollout/wait_for_room_s", time.perf_counter() - started, Reduce.SUM)
        if counts is not None:
            counts.waits_for_room += 1


async def rollout_step(
    *,
    dataset,
    rollouts: Rollouts,
    scorer: RolloutScorer,
    advantages,
    reference,
    replay_buffer,
    prompts_per_step: int,
    group_size: int,
    skip_groups_without_signal: bool,
    min_version: int = 0,
    counts: RolloutCounts | None = None,
    recorder: RolloutRecorder | None = None,
    teacher=None,
    token_advantages: TokenAdvantages | None = None,
    critic=None,
) -> list[int]:
    """Samples prompts, rolls out a group of trajectories per prompt with a policy of at least
    `min_version`, scores them and adds them to the buffer.

    Returns the policy versions of the episodes added. A group whose rewards are all equal has zero
    advantage everywhere: with `skip_groups_without_signal` it is not added (DAPO's dynamic
    sampling), and counted in `rollout/groups_skipped`. The caller waits for room in the buffer
    first (`wait_for_room`).
    Groups lost with a generator or environment replica that died or hung (after the service's retry), or
    whose environment failed, are counted in `rollout/groups_failed`. With `drop_truncated`,
    truncated trajectories leave after their group's advantages are computed (counted in
    `rollout/truncated_dropped`). The reference model (None: none) and the `teacher` (None: none)
    score the episodes' tokens, and so does the `critic` (None: none), and `token_advantages`
    (None: the group advantages alone) gives them per-token advantages. The `recorder` gets the groups that entered the buffer.
    """
    counts = counts if counts is not None else RolloutCounts()
    # Each stage's seconds: what a generator replica waits for between two of a loop's rollouts
    # is this loop's work outside `rollout/trajectories_s`.
    started = time.perf_counter()
    rows = await dataset.sample_batch.route(prompts_per_step)
    try:
        groups = await rollouts.groups(rows, [r["index"] for r in rows], min_version, group_size)
    except (ReplicaFailedError, NoHealthyReplicaError):  # the service is replacing the replica
        groups = [None] * len(rows)
        await asyncio.sleep(0.5)
    started = _record_stage("rollout/trajectories_s", started)
    failed = sum(g is None for g in groups)
    counts.groups_failed += failed
    record_metric("rollout/groups_failed", failed, Reduce.SUM)
    rows, groups = [r for r, g in zip(rows, groups, strict=True) if g], [g for g in groups if g]
    if not groups:
        return []
    scored = await score_groups(rows, groups, scorer, advantages)
    signal = [has_signal(torch.tensor([e.reward for e in g])) for g in scored]
    kept = [g for g, s in zip(scored, signal, strict=True) if s or not skip_groups_without_signal]
    skipped = [g for g, s in zip(scored, signal, strict=True) if not s and skip_groups_without_signal]
    record_metric("rollout/groups_skipped", len(skipped), Reduce.SUM)
    record_metric("rollout/groups", len(scored), Reduce.SUM)
    counts.groups += len(scored)
    counts.groups_skipped += len(skipped)
    # Empty text everywhere names a cause the rewards cannot: samples that decode to nothing.
    counts.groups_empty += sum(all(not e.completion.text.strip() for e in g) for g in skipped)
    for e in (e for g in scored for e in g):
        record_metric("rollout/response_len", e.response_len, Reduce.MEAN)
        record_metric("rollout/reward", e.reward, Reduce.MEAN)
    if rollouts.drop_truncated:
        kept = without_truncated(kept)
    episodes = [e for g in kept for e in g]
    if not episodes:
        return []
    await add_token_scores(episodes, reference, teacher, token_advantages, critic)
    started = _record_stage("rollout/score_s", started)
    await replay_buffer.add_many.route(episodes)
    if recorder is not None:
        recorder.record_groups(kept)
    _record_stage("rollout/add_s", started)
    return [e.policy_version for e in episodes]


def _record_stage(name: str, started: float) -> float:
    """Records the seconds since `started` under `name`; returns now, the next stage's start."""
    now = time.perf_counter()
    record_metric(name, now - started, Reduce.MEAN)
    return now
