"""Environments as a service, through the app: a replica whose process dies, or blocks its
thread, mid-run is killed or found dead and replaced, and the run goes on; an environment call
that raises or hangs fails its trajectory, which is rerun (env.retries) before its group is
dropped; the eval goes through the same environments and finishes too. One run covers them all
(it is the suite's most expensive kind of check)."""

import json
import os

import pytest
from apps.grpo.main import main
from processes import children_left

pytestmark = pytest.mark.slow

# The environment runs in the EnvironmentActor's processes, which import it by module path.
ENV_MODULE = """
import asyncio
import os
import random
import time
from pathlib import Path

from forge.envs import Environment, EnvStep


class Unreliable(Environment):
    '''Answers once, then ends. The first step of the whole run kills its process outright (like
    a crash in C code); the second blocks its process's thread (as C code or time.sleep in a loop
    would), which no deadline inside the process can interrupt. Then a step awaits forever on 5%
    of turns and raises on 20%, and every seventh row's reset raises.'''

    def __init__(self, markers: str):
        self.crashed, self.blocked = Path(markers + ".crashed"), Path(markers + ".blocked")

    async def reset(self, row):
        if row.get("index", 0) % 7 == 3:  # eval rows have no index
            raise RuntimeError("this row's task cannot be set up")
        self.turns = 0
        return [{"role": "user", "content": row["prompt"]}]

    async def step(self, text):
        if not self.crashed.exists():
            self.crashed.touch()
            os._exit(1)
        if not self.blocked.exists():
            self.blocked.touch()
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
    (folder / "unreliable_env.py").write_text(ENV_MODULE)
    monkeypatch.syspath_prepend(str(folder))  # checked here at start-up
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))
    return "unreliable_env:Unreliable"


def test_environments_that_crash_block_hang_or_raise_cost_episodes_not_the_run(
    write_grpo_config, env_module, tmp_path
):
    markers = tmp_path / "env"
    env = (
        f"{{name: '{env_module}', params: {{markers: '{markers}'}}, max_turns: 3, replicas: 2, "
        "step_timeout_s: 1, retries: 2}"
    )
    config = write_grpo_config(env=env)
    history = main(["--config", str(config), "eval.every=2", "max_steps=4"])
    assert (tmp_path / "env.crashed").exists() and (tmp_path / "env.blocked").exists()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # step 0: the first eval's
    assert len(history["eval_accuracy"]) == 3  # steps 0, 2 and 4: the eval finished every time

    def total(key):
        return sum(r.get(key, 0) for r in rows)

    # The crashed replica was found dead and the blocked one killed (it missed its call's
    # deadline); both were replaced.
    assert total("service/EnvironmentActor/hung") >= 1
    failures = sum(
        v
        for r in rows
        for k, v in r.items()
        if k.startswith("service/EnvironmentActor/") and k.endswith("/failures")
    )
    assert failures >= 2
    assert total("rollout/env_timeouts") >= 1  # the steps that awaited forever
    # Failed trajectories were rerun and their groups kept; the rows whose reset always raises
    # lose their groups.
    assert total("rollout/env_retries") >= 1
    assert total("rollout/env_failures") >= 1
    assert total("rollout/groups") >= 4
    # Trajectories of two model turns: the environment's message between them.
    assert all(r["rollout/turns"] == 2 for r in rows if "rollout/turns" in r)
    assert children_left(15) == []
