"""Guards of the training loop: diverging updates and a trainer that gets no data."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from forge.envs.config import EnvConfig
from forge.observability import Reduce, record_metric
from forge.rollout.env_failures import EnvFailures
from forge.rollout.step import RolloutCounts
from forge.runs.errors import RunStopped


class SkippedUpdates:
    """Counts the updates the trainer skipped (non-finite loss or gradient norm) and stops
    the run after `limit` in a row: the policy is then not learning, only burning time."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row = 0

    def observe(self, step: int, metrics: dict[str, float]) -> None:
        if not metrics.get("train/skipped"):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        record_metric("grpo/skipped_updates", 1, Reduce.SUM)
        if self.in_a_row >= self.limit:
            raise RunStopped(
                f"step {step}: {self.in_a_row} updates in a row were skipped because the loss or the "
                f"gradient norm was not finite (last: loss {metrics.get('train/loss')}, gradient norm "
                f"{metrics.get('train/grad_norm')}). Lower trainer.engine.optimizer.lr, check the rewards "
                "(reward/*/errors in the metrics), or raise trainer.max_skipped_updates"
            )


async def wait_for_batch(batch: Awaitable, timeout_s: float, explain: Callable[[], Awaitable[str]]):
    """Awaits `batch`; after `timeout_s` without it, stops the run with `explain()`'s account
    of where the episodes went."""
    try:
        return await asyncio.wait_for(batch, timeout_s)
    except TimeoutError:
        raise RunStopped(
            f"the trainer got no batch for {timeout_s:g} s (replay_buffer.starve_timeout_s). {await explain()}"
        ) from None


async def starvation_report(
    rollouts: RolloutCounts,
    replay_buffer,
    scorer,
    buffer_config,
    env: EnvConfig | None = None,
    env_failures: EnvFailures | None = None,
) -> str:
    """Counts since the start that explain a starving trainer (`buffer_config`: a
    `ReplayBufferConfig`). Reward errors and timeouts are every source's (`scorer`: the rollouts'
    `forge.rewards.sources.RolloutScorer`): the reward actor's functions and server, and the
    reward models. With `env`, the environment's failures (`env_failures`) are named, and said to
    explain the starvation when they dropped as many groups as were kept."""
    buffer = await replay_buffer.counts.route()
    return starvation_message(rollouts, buffer, scorer.counts, buffer_config, env, env_failures)


def starvation_message(
    rollouts: RolloutCounts,
    buffer: dict[str, int],
    rewards: dict[str, int],
    buffer_config,
    env: EnvConfig | None = None,
    env_failures: EnvFailures | None = None,
) -> str:
    """The report of `starvation_report` from the counts it gathered: the replay buffer's and the
    rewards' (errors and timeouts of every source)."""
    max_policy_age, batch_size = buffer_config.max_policy_age, buffer_config.batch_size
    return (
        f"Since the start: {rollouts.groups} groups generated, {rollouts.groups_skipped} skipped for no "
        f"signal (all rewards of the group equal; see rollout.skip_groups_without_signal), "
        f"{rollouts.groups_failed} lost with a failed generator or environment; {buffer['added']} episodes "
        f"added to the buffer, {buffer['evicted_stale']} evicted as stale (older than "
        f"replay_buffer.max_policy_age={max_policy_age}), {buffer['sampled']} trained on, {buffer['held']} "
        f"held (a batch needs {batch_size}); reward errors {rewards['errors']}, reward timeouts "
        f"{rewards['timeouts']}.{_cause(rollouts, rewards)}{_environment_report(rollouts, env, env_failures)}"
    )


def _cause(rollouts: RolloutCounts, rewards: dict[str, int]) -> str:
    """The dominant reason, when one reason took every group."""
    if rollouts.groups_failed and not rollouts.groups:
        return " The cause: every group was lost with a failed generator or environment (see the log)."
    if not rollouts.groups or rollouts.groups_skipped < rollouts.groups:
        return ""
    if rollouts.groups_empty == rollouts.groups_skipped:
        return (
            " The cause: every completion was empty text: the generator's samples decode to nothing "
            "(a tokenizer that is not the policy's, or a model that stops at once; see rollouts.jsonl)."
        )
    if rewards["errors"] or rewards["timeouts"]:
        return (
            " The cause: every group's rewards were equal, and reward calls failed (a failed call "
            "scores reward.error_reward): see the reward errors in the log."
        )
    return (
        " The cause: every group's rewards were equal: the task is too hard or too easy for the "
        "policy, or the reward does not tell completions apart."
    )


def _environment_report(rollouts: RolloutCounts, env: EnvConfig | None, failures: EnvFailures | None) -> str:
    if env is None or failures is None:
        return ""
    dropped = failures.groups_dropped
    cause = ""
    if dropped and dropped >= rollouts.groups:
        cause = " The environment's failures explain the starvation (the first of each kind is in the log)."
    return (
        f" Environment {env.name}: {dropped} groups dropped for its failures, {failures.timeouts} calls past "
        f"env.step_timeout_s={env.step_timeout_s:g} s, {failures.retries} trajectories rerun "
        f"(env.retries={env.retries}).{cause}"
    )
