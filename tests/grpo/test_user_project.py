"""forge from a user's own project: examples/my_project (a config, a reward function and an
environment in one directory) copied outside the checkout and run with the installed app from
yet another directory, as `python -m apps.grpo.main --config project/my_project.yaml`."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "my_project"


def test_the_example_project_runs_from_outside_the_checkout(tmp_path, tiny_policy):
    project = shutil.copytree(EXAMPLE, tmp_path / "project")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # No PYTHONPATH from this test process: the app must find its own modules and the project's.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "apps.grpo.main",
            "--config",
            "../project/my_project.yaml",
            f"policy_path={tiny_policy}",
            "max_steps=2",
            "eval.every=0",
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "rollout.skip_groups_without_signal=false",
            "replay_buffer.batch_size=16",
        ],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [
        json.loads(line) for line in (elsewhere / "runs/my_project/metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [1, 2]
    # The project's reward scored the episodes, and its environment took the turns.
    assert any("reward/rewards:close_enough" in r for r in rows)
    assert all(r["rollout/groups_failed"] == 0 for r in rows if "rollout/groups_failed" in r)
    assert any(r.get("rollout/turns", 0) >= 1 for r in rows)
    assert str(project) not in os.environ.get("PYTHONPATH", "")  # this process was left alone
