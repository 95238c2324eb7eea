"""Durable GRPO runs, end to end with real actors: bad values and hung rewards cost nothing,
checkpoints and the export are complete, a dead actor stops the run by name, a killed
generator replica is replaced, and a killed run resumes to the same numbers."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from apps.grpo.main import main
from processes import children_left
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge.actors.generator import GeneratorConfig, build_generation_engine
from forge.engines.generation import SamplingParams

# Reward functions run in the reward actor's process (and its worker), which imports them
# by module path: they live in a module written to a folder put on PYTHONPATH.
REWARDS_MODULE = """
import math, os, time
from pathlib import Path

def hangs_once(prompt, response, target):
    marker = Path(os.environ["DURABLE_TEST_HANG_MARKER"])
    if not marker.exists():
        marker.touch()
        time.sleep(3600)
    return 1.0

def inf_on_even_length(prompt, response, target):
    return math.inf if len(response) % 2 == 0 else 0.5

def by_characters(prompt, response, target):
    return sum(map(ord, response)) % 7 / 7  # varies within a group even for a random policy
"""


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    folder = tmp_path / "rewards_module"
    folder.mkdir()
    (folder / "durable_rewards.py").write_text(REWARDS_MODULE)
    monkeypatch.syspath_prepend(str(folder))  # the config names it: checked here at start-up
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("DURABLE_TEST_HANG_MARKER", str(tmp_path / "hung_once"))
    return "durable_rewards"


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def total(rows: list[dict], key: str) -> float:
    return sum(r.get(key, 0.0) for r in rows)


def test_hung_and_infinite_rewards_cost_nothing_and_the_run_checkpoints_and_exports(
    write_grpo_config, tiny_policy, tmp_path, rewards_module
):
    hang, inf = f"{rewards_module}:hangs_once", f"{rewards_module}:inf_on_even_length"
    config = write_grpo_config(
        reward=f"{{timeout_s: 1.0, functions: [{{name: toy_task}}, {{name: '{hang}', weight: 0.0}}, "
        f"{{name: '{inf}'}}]}}",
        checkpoint="{every: 2, keep: 1}",
    )
    history = main(["--config", str(config), "replay_buffer.max_size=8"])
    run = tmp_path / "run"
    rows = read_rows(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and len(history["eval_accuracy"]) == 4

    # The hung call timed out once and was counted; the inf rewards were errors, never rewards.
    assert total(rows, f"reward/{hang}/timeouts") == 1
    assert total(rows, f"reward/{inf}/errors") > 0
    assert all(math.isfinite(r.get("reward/total", 0.0)) and r["train/skipped"] == 0 for r in rows[1:])

    # keep=1: only the last checkpoint (every 2 steps, and the last step) is left, complete.
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000003"]
    assert (run / "checkpoints" / "step_00000003" / "trainer" / ".metadata").is_file()

    # The export is the trained policy: transformers loads it, its parameters are finite and
    # differ from the initial policy's, and the generator's engine samples from it.
    export = run / "export"
    model = AutoModelForCausalLM.from_pretrained(export)
    initial = AutoModelForCausalLM.from_pretrained(tiny_policy)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), initial.parameters(), strict=True))
    tokenizer = AutoTokenizer.from_pretrained(export)
    engine = build_generation_engine(GeneratorConfig(model_path=str(export)), tokenizer.eos_token_id)
    [[sample]] = engine.generate([tokenizer("12+34=").input_ids], SamplingParams(max_tokens=4, temperature=0))
    assert len(sample.token_ids) >= 1


def actor_processes(app_pid: int, name: str) -> list[psutil.Process]:
    """The app's live actor processes of meshes launched as `name`, newest mesh last (Monarch
    names each process after its mesh, `<name>_<n>`; an earlier run's may still be exiting)."""
    found = []
    for child in psutil.Process(app_pid).children(recursive=True):
        try:
            process_name = child.environ().get("HYPERACTOR_PROCESS_NAME", "")
            if child.status() != psutil.STATUS_ZOMBIE and (
                m := re.match(rf"{name.lower()}_(\d+)-", process_name)
            ):
                found.append((int(m.group(1)), child))
        except psutil.Error:
            continue
    return [child for _, child in sorted(found, key=lambda item: item[0])]


SYNC = ["seed=3", "max_steps=4", "replay_buffer.max_policy_age=0", "rollout.threads=1", "checkpoint.every=2"]
# Values of what each step trained on: rollout/reward depends on which rollouts finished
# before the step's flush, which differs between any two runs.
COMPARED = ("train/loss", "loss/pg", "loss/kl", "train/grad_norm", "buffer/sampled_reward", "eval/accuracy")


def test_a_killed_trainer_names_itself_and_the_run_resumes_to_the_same_numbers(
    write_grpo_config, tmp_path, rewards_module
):
    config = write_grpo_config(reward=f"{{functions: [{{name: '{rewards_module}:by_characters'}}]}}")
    straight = tmp_path / "straight"
    main(["--config", str(config), *SYNC, f"output_dir={straight}", f"metrics.jsonl_path={straight}/m.jsonl"])

    killed = tmp_path / "killed"
    argv = ["--config", str(config), *SYNC, f"output_dir={killed}", f"metrics.jsonl_path={killed}/m.jsonl"]
    app = subprocess.Popen(
        [sys.executable, "-m", "apps.grpo.main", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 600
        while not (killed / "checkpoints" / "step_00000002" / "run_state.pt").exists():
            assert app.poll() is None and time.time() < deadline, "the run ended before its step-2 checkpoint"
            time.sleep(0.1)
        [trainer] = actor_processes(app.pid, "TitanTrainer")
        trainer.send_signal(signal.SIGKILL)
        output = app.communicate(timeout=180)[0]
    finally:
        app.kill()
    assert app.returncode == 1, output[-3000:]
    # Named by whichever comes first, the failed call or Monarch's report of the death; the
    # reason's wording varies ("Killed(sig=9)", or a timeout waiting for the dead process).
    assert re.search(r"error: actor TitanTrainer_\d+ died", output), output[-3000:]
    assert (
        f"newest checkpoint: {killed / 'checkpoints' / 'step_00000002'} (continue with resume=true)" in output
    )

    main([*argv, "resume=true"])
    expected, resumed = read_rows(straight / "m.jsonl"), read_rows(killed / "m.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]  # step 0 (the initial eval), no repeats, no gaps
    assert all(r["train/loss"] != 0 for r in expected[1:])  # the comparison below is not of zeros
    for want, got in zip(expected, resumed, strict=True):
        for key in COMPARED:
            assert got.get(key) == want.get(key), (
                f"step {want['step']}: {key} {got.get(key)} != {want.get(key)}"
            )


def test_a_killed_generator_replica_is_replaced_and_the_run_completes(write_grpo_config, tmp_path):
    config = write_grpo_config()
    metrics = tmp_path / "run" / "metrics.jsonl"
    app_pid, killed = os.getpid(), []

    def kill_one_replica_after_step_1():
        deadline = time.time() + 600
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.1)
        replicas = actor_processes(app_pid, "Generator")[-2:]  # this run's two replicas
        if len(replicas) == 2:
            replicas[0].send_signal(signal.SIGKILL)
            killed.append(replicas[0].pid)

    killer = threading.Thread(target=kill_one_replica_after_step_1, daemon=True)
    killer.start()
    history = main(["--config", str(config), "generator.replicas=2", "max_steps=5"])
    killer.join(timeout=5)
    assert killed, "no generator replica was killed"
    # Shutdown stopped the service before its replicas: no replacement started as they stopped.
    assert children_left(15) == []
    rows = read_rows(metrics)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert [s for s, _ in history["eval_accuracy"]] == [0, 1, 2, 3, 4, 5]
    # Every group generated was either added, skipped or counted as failed.
    assert total(rows, "rollout/groups") + total(rows, "rollout/groups_failed") > 0
