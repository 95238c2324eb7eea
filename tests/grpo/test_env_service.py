"""Environments as a service: a replica whose process dies mid-run is replaced, the groups it held
are counted as failed, and the run goes on; an environment that raises loses only its group."""

import json
import os

import pytest
from apps.grpo.main import main
from processes import children_left

pytestmark = pytest.mark.slow

# The environment runs in the EnvironmentActor's processes, which import it by module path.
ENV_MODULE = """
import os
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
"""


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    folder = tmp_path / "env_module"
    folder.mkdir()
    (folder / "crashing_env.py").write_text(ENV_MODULE)
    monkeypatch.syspath_prepend(str(folder))  # checked here at start-up
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))
    return "crashing_env:CrashesOnce"


def test_a_dead_environment_replica_is_replaced_and_the_run_goes_on(write_grpo_config, env_module, tmp_path):
    marker = tmp_path / "crashed"
    env = f"{{name: '{env_module}', params: {{marker: '{marker}'}}, max_turns: 3, replicas: 2}}"
    config = write_grpo_config(env=env)
    history = main(["--config", str(config), "eval.every=0", "max_steps=4"])
    assert marker.exists(), "no environment step ran"
    assert history["eval_accuracy"] == []  # eval.every=0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    failed = sum(r.get("rollout/groups_failed", 0) for r in rows)
    # The crash lost the groups of the rollout in flight on that replica; reset errors lose theirs.
    assert failed >= 2
    assert sum(r.get("rollout/env_failures", 0) for r in rows) >= 1
    assert all(r["train/skipped"] == 0 for r in rows)
    # Trajectories of two model turns: the environment's message between them.
    assert all(r["rollout/turns"] == 2 for r in rows if "rollout/turns" in r)
    assert children_left(15) == []
