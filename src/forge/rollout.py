"""One rollout step of GRPO-style training, over actor handles: prompts -> scored episodes.

Kept out of the app so that other recipes (and users' environments) can reuse it; every
call goes to an actor handle (`call_one`) or a service endpoint (`route`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from forge.controller.service import NoHealthyReplicaError, ReplicaFailedError
from forge.data.types import Completion, Episode
from forge.observability import Reduce, record_metric
from forge.observability.rollouts import RolloutRecorder
from forge.rl.advantage import has_signal


def _call(endpoint):
    """`route` for a service endpoint, `call_one` for a single actor's."""
    return endpoint.route if hasattr(endpoint, "route") else endpoint.call_one


async def score_groups(
    rows: list[dict], groups: list[list[Completion]], reward, advantages
) -> list[list[Episode]]:
    """Rewards, then group-relative advantages, for the completions of each prompt (two calls)."""
    # Reward functions take the prompt as a string: `Completion.prompt`, a string prompt as
    # written, chat messages as the chat template rendered them (the whole conversation).
    scores = await _call(reward.evaluate_groups)(
        [g[0].prompt for g in groups], [[c.text for c in g] for g in groups], [r["target"] for r in rows]
    )
    values = await _call(advantages.compute_groups)([[total for total, _ in group] for group in scores])
    scored = []
    for row, group, group_scores, group_values in zip(rows, groups, scores, values, strict=True):
        group_id = uuid.uuid4().hex
        scored.append(
            [
                Episode(c, row["target"], group_id, reward=total, reward_breakdown=breakdown, advantage=adv)
                for c, (total, breakdown), adv in zip(group, group_scores, group_values, strict=True)
            ]
        )
    return scored


async def add_reference_logprobs(episodes: list[Episode], reference) -> None:
    """Fills `ref_logprobs` of each episode from the reference model (one batched call)."""
    rows = await _call(reference.forward)([e.completion for e in episodes])
    for episode, row in zip(episodes, rows, strict=True):
        episode.ref_logprobs = row


@dataclass
class RolloutCounts:
    """What the rollout loops did since the start, for messages that explain a run's state."""

    groups: int = 0
    groups_skipped: int = 0  # no signal: every reward of the group was equal
    groups_failed: int = 0  # lost with a generator replica that died
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
    while not await _call(replay_buffer.has_room)(trainer_version() if trainer_version else None):
        waited = True
        await asyncio.sleep(poll_s)
    if waited:
        record_metric("rollout/wait_for_room_s", time.perf_counter() - started, Reduce.SUM)
        if counts is not None:
            counts.waits_for_room += 1


async def rollout_step(
    *,
    dataset,
    generator,
    reward,
    advantages,
    reference,
    replay_buffer,
    prompts_per_step: int,
    group_size: int,
    skip_groups_without_signal: bool,
    min_version: int = 0,
    counts: RolloutCounts | None = None,
    recorder: RolloutRecorder | None = None,
) -> list[int]:
    """Samples prompts, generates a group per prompt with a policy of at least `min_version`,
    scores it and adds it to the buffer.

    Returns the policy versions of the episodes added. A group whose rewards are all equal has zero
    advantage everywhere: with `skip_groups_without_signal` it is not added (DAPO's dynamic
    sampling), and counted in `rollout/groups_skipped`. The caller waits for room in the buffer
    first (`wait_for_room`).
    Groups lost with a generator replica that died (after the service's retry) are counted
    in `rollout/groups_failed`. The `recorder` gets the groups that entered the buffer.
    """
    counts = counts if counts is not None else RolloutCounts()
    rows = await _call(dataset.sample_batch)(prompts_per_step)
    try:
        groups = await _call(generator.generate_batch)(
            [r["prompt"] for r in rows], [r["index"] for r in rows], min_version, n=group_size
        )
    except (ReplicaFailedError, NoHealthyReplicaError):  # the service is replacing the replica
        counts.groups_failed += len(rows)
        record_metric("rollout/groups_failed", len(rows), Reduce.SUM)
        await asyncio.sleep(0.5)
        return []
    scored = await score_groups(rows, groups, reward, advantages)
    kept = [
        g for g in scored if not skip_groups_without_signal or has_signal(torch.tensor([e.reward for e in g]))
    ]
    record_metric("rollout/groups_skipped", len(scored) - len(kept), Reduce.SUM)
    record_metric("rollout/groups", len(scored), Reduce.SUM)
    counts.groups += len(scored)
    counts.groups_skipped += len(scored) - len(kept)
    episodes = [e for g in kept for e in g]
    for e in (e for g in scored for e in g):
        record_metric("rollout/response_len", e.response_len, Reduce.MEAN)
        record_metric("rollout/reward", e.reward, Reduce.MEAN)
    if not episodes:
        return []
    if reference is not None:
        await add_reference_logprobs(episodes, reference)
    await _call(replay_buffer.add_many)(episodes)
    if recorder is not None:
        recorder.record_groups(kept)
    return [e.policy_version for e in episodes]


async def greedy_accuracy(
    generator,
    rows: list[dict],
    score_fn,
    max_tokens: int,
    min_version: int = 0,
    recorder: RolloutRecorder | None = None,
) -> float:
    """Fraction of `rows` whose greedy completion, by a policy of at least `min_version`,
    scores 1.0 under `score_fn`; the `recorder` gets every answer, as eval records."""
    if not rows:
        return float("nan")
    groups = await _call(generator.generate_batch)(
        [r["prompt"] for r in rows], None, min_version, n=1, temperature=0.0, max_tokens=max_tokens
    )
    completions = [g[0] for g in groups]
    targets = [r["target"] for r in rows]
    scores = [score_fn(c.prompt, c.text, t) for c, t in zip(completions, targets, strict=True)]
    if recorder is not None:
        recorder.record_eval(completions, targets, scores)
    return sum(s == 1.0 for s in scores) / len(rows)
