"""Durable GRPO runs, end to end with real actors: bad values, hung rewards and a killed
generator replica (replaced) cost nothing, checkpoints and the export are complete, a dead
trainer stops the run by name, and a killed run resumes to the same numbers: those of the
serial recipe, which the app in sync mode equals step for step."""

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
from apps.grpo.config import GRPOConfig
from apps.grpo.main import main
from processes import children_left
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge.actors.generator import GeneratorConfig, build_generation_engine
from forge.config import load_config
from forge.engines.generation import SamplingParams
from forge.recipes.grpo_serial import grpo_serial

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


def kill_a_generator_replica_once_training_starts(metrics: Path, killed: list[int]) -> threading.Thread:
    """Kills one of this run's two generator replicas once the first metrics row (step 0's
    eval) is written, while the first rollouts run."""
    app_pid = os.getpid()

    def kill() -> None:
        deadline = time.time() + 600
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.1)
        replicas = actor_processes(app_pid, "Generator")[-2:]  # this run's two replicas
        if len(replicas) == 2:
            replicas[0].send_signal(signal.SIGKILL)
            killed.append(replicas[0].pid)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    return killer


def test_faults_cost_nothing_and_the_run_checkpoints_and_exports(
    write_grpo_config, tiny_policy, tmp_path, rewards_module
):
    """A hung reward, infinite rewards and a killed generator replica, in one run."""
    hang, inf = f"{rewards_module}:hangs_once", f"{rewards_module}:inf_on_even_length"
    config = write_grpo_config(
        reward=f"{{timeout_s: 1.0, functions: [{{name: toy_task}}, {{name: '{hang}', weight: 0.0}}, "
        f"{{name: '{inf}'}}]}}",
        checkpoint="{every: 2, keep: 1}",
    )
    run = tmp_path / "run"
    killed: list[int] = []
    killer = kill_a_generator_replica_once_training_starts(run / "metrics.jsonl", killed)
    history = main(
        ["--config", str(config), "replay_buffer.max_size=8", "generator.replicas=2", "max_steps=5"]
    )
    killer.join(timeout=5)
    assert killed, "no generator replica was killed"
    # Shutdown stopped the service before its replicas: no replacement started as they stopped.
    assert children_left(15) == []
    rows = read_rows(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert [s for s, _ in history["eval_accuracy"]] == [0, 1, 2, 3, 4, 5]

    # The hung call timed out once and was counted; the inf rewards were errors, never rewards.
    assert total(rows, f"reward/{hang}/timeouts") == 1
    assert total(rows, f"reward/{inf}/errors") > 0
    assert all(math.isfinite(r.get("reward/total", 0.0)) and r["train/skipped"] == 0 for r in rows[1:])
    # Every group generated was either added, skipped or counted as failed.
    assert total(rows, "rollout/groups") + total(rows, "rollout/groups_failed") > 0

    # keep=1: only the last checkpoint (every 2 steps, and the last step) is left, complete.
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000005"]
    assert (run / "checkpoints" / "step_00000005" / "trainer" / ".metadata").is_file()

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


# The app in sync mode: with max_policy_age 0, one rollout loop and a seed, the actor pipeline
# is the serial recipe (forge.recipes.grpo_serial), step for step. Equality is bit-exact, not to
# a tolerance: both sides run the same float32 CPU kernels on one thread (actor_threads: 1; the
# serial recipe sets the same), the same engines, the same seeded per-(prompt, sample) draws
# and the same buffer sampling, so every operation sees the same inputs in the same order.
# Weights travel through the store as exact copies. (The one reduction order that differs, the
# metric logger's merge of per-process means, reduces a single value per step here.)
SYNC = [
    "seed=3",
    "max_steps=4",
    "actor_threads=1",
    "rollout.threads=1",
    "rollout.skip_groups_without_signal=true",
    "replay_buffer.max_policy_age=0",
    "checkpoint.every=2",
]
# Values of what each step trained on: rollout/reward depends on which rollouts finished
# before the step's flush, which differs between any two runs.
COMPARED = (
    "train/loss",
    "loss/pg",
    "loss/kl",
    "loss/ratio_mean",
    "train/grad_norm",
    "buffer/sampled_reward",
    "eval/accuracy",
)


def test_a_killed_trainer_names_itself_and_the_resumed_run_equals_the_serial_recipe(
    write_grpo_config, tmp_path, rewards_module
):
    """The killed run's steps before the kill, and the resumed run's after it, are the serial
    recipe's numbers: the pipeline is the recipe, and a resume loses or repeats nothing."""
    config = write_grpo_config(reward=f"{{functions: [{{name: '{rewards_module}:by_characters'}}]}}")
    serial = grpo_serial(load_config(GRPOConfig, config, SYNC))
    expected = [{"step": 0, "eval/accuracy": serial["eval_accuracy"][0][1]}, *serial["metrics"]]

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
    resumed = read_rows(killed / "m.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]  # step 0 (the initial eval), no repeats, no gaps
    assert len({r["train/loss"] for r in expected[1:]}) == 4  # the comparison below is not of constants
    for want, got in zip(expected, resumed, strict=True):
        for key in COMPARED if want["step"] else ("eval/accuracy",):
            assert got[key] == want[key], (
                f"step {want['step']}: {key} {got[key]} != {want[key]} (serial recipe)"
            )
