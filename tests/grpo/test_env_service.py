"""Environments as a service: a replica whose process dies, or blocks, mid-run is replaced and the
run goes on; an environment call that raises or hangs fails its trajectory, which is rerun
(env.retries) before its group is dropped."""

import json
import os

import pytest
from apps.grpo.main import main
from processes import children_left

pytestmark = pytest.mark.slow

# The environments run in the EnvironmentActor's processes, which import them by module path.
ENV_MODULE = """
import asyncio
import os
import random
import time
from pathlib import Path

from forge.envs import Environment, EnvStep


class CrashesOnce(Environment):
    '''Answers once, then ends; the first step of the whole run kills its process outright
    (like a crash in C code), and every seventh row's reset raises.'''

    def __init__(self, marker: str):
        self.marker = Path(marker)

    async def reset(self, row):
        if row["index"] % 7 == 3:
            raise RuntimeError("this row's task cannot be set up")
        self.turns = 0
        return [{"role": "user", "content": row["prompt"]}]

    async def step(self, text):
        if not self.marker.exists():
            self.marker.touch()
            os._exit(1)
        self.turns += 1
        if self.turns == 2:
            return EnvStep([], reward=len(text) % 3 / 2, done=True)
        return EnvStep([{"role": "tool", "content": "<result>1</result>"}], reward=0.1)


class FlakyTools(Environment):
    '''Answers once, then ends. A step awaits forever on 5% of turns and raises on 20%; the
    first step of the whole run blocks its process's thread (as C code or time.sleep in a
    loop would), which no deadline inside the process can interrupt.'''

    def __init__(self, marker: str):
        self.marker = Path(marker)

    async def reset(self, row):
        self.turns = 0
        return [{"role": "user", "content": row["prompt"]}]

    async def step(self, text):
        if not self.marker.exists():
            self.marker.touch()
            time.sleep(1e6)
        draw = random.random()
        if draw < 0.05:
            await asyncio.sleep(1e6)
        if draw < 0.25:
            raise RuntimeError("the tool failed")
        self.turns += 1
        if self.turns == 2:
            return EnvStep([], reward=len(text) % 3 / 2, done=True)
        return EnvStep([{"role": "tool", "content": "<result>1</result>"}], reward=0.1)
"""


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    folder = tmp_path / "env_module"
    folder.mkdir()
    (folder / "test_envs.py").write_text(ENV_MODULE)
    monkeypatch.syspath_prepend(str(folder))  # checked here at start-up
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))
    return "test_envs"


def metric_rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_dead_environment_replica_is_replaced_and_the_run_goes_on(write_grpo_config, env_module, tmp_path):
    marker = tmp_path / "crashed"
    # No reruns: the trajectories lost with the replica drop their groups.
    env = (
        f"{{name: '{env_module}:CrashesOnce', params: {{marker: '{marker}'}}, max_turns: 3, replicas: 2, "
        "retries: 0}"
    )
    config = write_grpo_config(env=env)
    history = main(["--config", str(config), "eval.every=0", "max_steps=4"])
    assert marker.exists(), "no environment step ran"
    assert history["eval_accuracy"] == []  # eval.every=0
    rows = metric_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    failed = sum(r.get("rollout/groups_failed", 0) for r in rows)
    # The crash lost the groups of the rollout in flight on that replica; reset errors lose theirs.
    assert failed >= 2
    assert sum(r.get("rollout/env_failures", 0) for r in rows) >= 1
    assert all(r["train/skipped"] == 0 for r in rows)
    # Trajectories of two model turns: the environment's message between them.
    assert all(r["rollout/turns"] == 2 for r in rows if "rollout/turns" in r)
    assert children_left(15) == []


def test_environments_that_hang_block_or_raise_cost_episodes_not_the_run(
    write_grpo_config, env_module, tmp_path
):
    marker = tmp_path / "blocked"
    env = (
        f"{{name: '{env_module}:FlakyTools', params: {{marker: '{marker}'}}, max_turns: 3, "
        "step_timeout_s: 2, retries: 2}"
    )
    config = write_grpo_config(env=env)
    main(["--config", str(config), "eval.every=0", "max_steps=4"])
    assert marker.exists(), "no environment step ran"
    rows = metric_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]

    def total(key):
        return sum(r.get(key, 0) for r in rows)

    # The blocked replica (the only one: env.replicas is 1) was killed and replaced.
    assert total("service/EnvironmentActor/hung") >= 1
    assert total("rollout/env_timeouts") >= 1  # the steps that awaited forever
    # Failed trajectories were rerun, and groups kept.
    assert total("rollout/env_retries") >= 1
    assert total("rollout/groups") >= 4
    assert all(r["train/skipped"] == 0 for r in rows)
    assert children_left(15) == []
