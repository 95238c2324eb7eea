"""Environment failures in rollouts, in one process with the native engine on a tiny model:
deadlines on every environment call, reruns of the failed trajectories (not their groups),
summarised warnings, and a starvation report that names the environment.

The test environments fail chosen trajectories by the order of their calls (a rollout steps
its trajectories in slot order: row by row, sample by sample), or by the row.
"""

import asyncio
import logging

import pytest
import torch
from hf_checkpoints import tiny_qwen3_config
from transformers import AutoModelForCausalLM

from forge.data.chat_prompts import PromptRenderer
from forge.data.tokenizer import embedded_tokenizer
from forge.engines.generation import SamplingParams, sample_seed, to_completions
from forge.engines.hf_generate import HFGenerateEngine
from forge.envs import EnvStep
from forge.envs.base import Environment
from forge.envs.config import EnvConfig
from forge.envs.sessions import EnvFailure, LocalEnvironments
from forge.envs.turns import TurnRenderer
from forge.observability.collector import pop_state
from forge.replay_buffer import ReplayBufferConfig
from forge.rollout.env_failures import EnvFailures
from forge.rollout.groups import TrajectoryLimits, run_groups
from forge.rollout.step import RolloutCounts
from forge.runs.guards import starvation_message

TOKENIZER = embedded_tokenizer()
ROWS = [{"prompt": "1+2=", "index": 3}, {"prompt": "4+5=", "index": 9}]
GROUP = 4
TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(len(TOKENIZER), TOKENIZER.eos_token_id))
    return HFGenerateEngine(model, eos_token_id=TOKENIZER.eos_token_id, tokenizer=TOKENIZER)


class RecordingGenerate:
    """The engine behind `run_groups`, remembering each call's shape (prompts, sample keys, n)
    and what it sampled."""

    def __init__(self, engine):
        self.engine, self.calls, self.outputs = engine, [], []

    async def __call__(self, prompt_ids, sample_keys, n, max_tokens, **sampling):
        outputs = self.engine.generate(
            prompt_ids, SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=0), sample_keys
        )
        self.calls.append(
            (len(prompt_ids), list(sample_keys) if sample_keys else [None] * len(prompt_ids), n)
        )
        completions = to_completions([""] * len(prompt_ids), prompt_ids, outputs, TOKENIZER, 0)
        self.outputs.append(completions)
        return completions


def ids(completions) -> list[list[int]]:
    return [c.response_ids for c in completions]


class FailsOnChosenTurns(Environment):
    """One step, then done. Of the first attempt's steps, in slot order, the second (row 3's
    sample 1) raises and the seventh (row 9's sample 2) hangs (awaiting); every close is counted."""

    closed = steps = 0

    async def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    async def step(self, text):
        type(self).steps += 1
        if self.steps == 2:
            raise RuntimeError("the tool crashed")
        if self.steps == 7:
            await asyncio.sleep(1e6)
        return EnvStep([], reward=1.0, done=True)

    async def close(self):
        type(self).closed += 1


class FailsRow9(Environment):
    """Row 9's trajectories fail at every step; the second reset of row 3 in the test raises."""

    resets = 0

    async def reset(self, row):
        self.row = row["index"]
        if self.row == 3:
            type(self).resets += 1
            if type(self).resets == 2:
                raise ConnectionError("the sandbox did not start")
        return [{"role": "user", "content": row["prompt"]}]

    async def step(self, text):
        if self.row == 9:
            raise ValueError("bad tool call")
        return EnvStep([], done=True)


class Hangs(Environment):
    """Awaits forever: row 9's reset, every step (but one whose tool raises its own
    TimeoutError) and every close."""

    async def reset(self, row):
        if row["index"] == 9:
            await asyncio.sleep(1e6)
        return [{"role": "user", "content": row["prompt"]}]

    async def step(self, text):
        if text == "own":
            raise TimeoutError("the tool's socket timed out")
        await asyncio.sleep(1e6)

    async def close(self):
        await asyncio.sleep(1e6)


class AlwaysRaises(Environment):
    async def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    async def step(self, text):
        raise RuntimeError(f"flaky tool on {text}")


def rollout(env, generate, retries, failures=None, sample_keys=(3, 9)):
    renderer = TurnRenderer(PromptRenderer(TOKENIZER, "auto"))
    return asyncio.run(
        run_groups(
            ROWS,
            list(sample_keys) if sample_keys is not None else None,
            group_size=GROUP,
            generate=generate,
            renderer=renderer,
            max_tokens=4,
            envs=LocalEnvironments(f"{__name__}:{env.__name__}", step_timeout_s=TIMEOUT_S),
            limits=TrajectoryLimits(max_turns=3, max_tokens=64, retries=retries),
            failures=failures,
        )
    )


def env_metrics() -> dict[str, float]:
    return {k: v.value() for k, v in pop_state().items() if k.startswith("rollout/env")}


def test_every_environment_call_has_a_deadline_and_a_failure_kind():
    envs = LocalEnvironments(f"{__name__}:Hangs", step_timeout_s=TIMEOUT_S)

    async def run():
        openings = await envs.reset(["a", "b"], ROWS)
        steps = await envs.step(["a", "gone"], ["hang", "x"])
        own = await envs.step(["a"], ["own"])
        return openings, steps, own, await envs.close(["a", "b"])

    [opened, reset_hung], [step_hung, lost], [own], closes = asyncio.run(run())
    assert not isinstance(opened, EnvFailure)
    assert (reset_hung.call, reset_hung.kind) == ("reset", "timeout")
    assert (step_hung.call, step_hung.kind) == ("step", "timeout")
    assert "env.step_timeout_s=0.5 s" in step_hung.message
    # A trajectory no environment holds (its replica was replaced) fails; it is no KeyError.
    assert (lost.call, lost.kind) == ("step", "lost")
    # The environment's own TimeoutError is an error it raised, not a deadline missed.
    assert (own.kind, own.message) == (
        "raised",
        f"{__name__}:Hangs.step() raised TimeoutError: the tool's socket timed out",
    )
    assert [(f.call, f.kind) for f in closes] == [("close", "timeout")] * 2


def test_a_failed_trajectory_is_rerun_and_its_group_kept(engine):
    pop_state()
    FailsOnChosenTurns.closed = FailsOnChosenTurns.steps = 0
    generate = RecordingGenerate(engine)
    groups = rollout(FailsOnChosenTurns, generate, retries=1)
    assert all(g is not None and len(g) == GROUP for g in groups)
    # The first turns in one call; the reruns' in one call, n=1 each, on streams of their own.
    retry_keys = [sample_seed(3, 1, -1), sample_seed(9, 2, -1)]
    assert generate.calls == [(2, [3, 9], GROUP), (2, retry_keys, 1)]
    first, [[rerun_3], [rerun_9]] = generate.outputs
    assert ids(groups[0]) == ids([first[0][0], rerun_3, first[0][2], first[0][3]])
    assert ids(groups[1]) == ids([first[1][0], first[1][1], rerun_9, first[1][3]])
    assert env_metrics() == {"rollout/env_retries": 2, "rollout/env_timeouts": 1}
    assert FailsOnChosenTurns.closed == 2 * GROUP + 2  # every environment, the failed ones too


def test_a_trajectory_that_fails_every_attempt_drops_its_group_only(engine):
    pop_state()
    FailsRow9.resets = 0
    generate = RecordingGenerate(engine)
    failures = EnvFailures()
    groups = rollout(FailsRow9, generate, retries=1, failures=failures, sample_keys=None)
    assert groups[1] is None
    # Row 3's second slot did not open: its sample of the first call is not used, and it is
    # rerun alone.
    assert generate.calls[:2] == [(2, [None, None], GROUP), (1 + GROUP, [None] * (1 + GROUP), 1)]
    first, rerun = generate.outputs[:2]
    assert ids(groups[0]) == ids([first[0][0], rerun[0][0], first[0][2], first[0][3]])
    assert env_metrics() == {"rollout/env_retries": 1 + GROUP, "rollout/env_failures": 1}
    assert (failures.groups_dropped, failures.retries, failures.timeouts) == (1, 1 + GROUP, 0)


def test_repeated_failures_are_logged_once_then_counted_per_step(engine, caplog):
    failures = EnvFailures()
    with caplog.at_level(logging.WARNING):
        for _ in range(2):  # two rollout steps, 16 failures each
            assert rollout(AlwaysRaises, RecordingGenerate(engine), retries=1, failures=failures) == [
                None,
                None,
            ]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert lines[0].startswith(f"{__name__}:AlwaysRaises.step() raised RuntimeError: flaky tool on")
    assert lines[1].startswith("15 more environment step() failures (raised) in this rollout step")
    assert lines[2].startswith("16 more environment step() failures (raised) in this rollout step")


# The replay buffer's counts of a run that trained nothing.
NOTHING_BUFFERED = {"added": 0, "evicted_stale": 0, "sampled": 0, "held": 0}


def test_the_starvation_report_names_the_environment_that_failed(engine):
    failures = EnvFailures()
    FailsOnChosenTurns.steps = 0
    rollout(FailsOnChosenTurns, RecordingGenerate(engine), retries=0, failures=failures)
    env = EnvConfig(name=f"{__name__}:FailsOnChosenTurns", step_timeout_s=TIMEOUT_S, retries=0)
    report = starvation_message(
        RolloutCounts(groups_failed=2),
        NOTHING_BUFFERED,
        {"errors": 0, "timeouts": 0},
        ReplayBufferConfig(),
        env,
        failures,
    )
    assert (
        f"Environment {env.name}: 2 groups dropped for its failures, 1 calls past env.step_timeout_s=0.5 s, "
        "0 trajectories rerun (env.retries=0). The environment's failures explain the starvation"
    ) in report


@pytest.mark.parametrize(
    "counts, rewards, cause",
    [
        (
            RolloutCounts(groups=4, groups_skipped=4, groups_empty=4),
            (0, 0),
            "every completion was empty text",
        ),
        (RolloutCounts(groups=4, groups_skipped=4, groups_empty=1), (3, 1), "reward calls failed"),
        (RolloutCounts(groups=4, groups_skipped=4), (0, 0), "too hard or too easy for the policy"),
        (RolloutCounts(groups_failed=3), (0, 0), "every group was lost with a failed generator"),
        (RolloutCounts(groups=4, groups_skipped=3, groups_empty=3), (0, 0), None),
    ],
)
def test_the_starvation_report_names_the_cause_that_took_every_group(counts, rewards, cause):
    errors, timeouts = rewards
    report = starvation_message(
        counts, NOTHING_BUFFERED, {"errors": errors, "timeouts": timeouts}, ReplayBufferConfig()
    )
    if cause is None:
        assert "The cause" not in report
    else:
        assert cause in report.split("The cause: ")[1]
