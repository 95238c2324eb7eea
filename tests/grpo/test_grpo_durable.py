"""Durable GRPO runs, end to end with real actors: bad values, hung rewards, a killed generator
replica and one that hangs while alive (both replaced) cost nothing, a lone generator that hangs
stops the run by name (and its resume skips a damaged newest checkpoint for the one before),
checkpoints and the export are complete, a dead
trainer stops the run by name, and a killed run resumes to the same numbers: those of the
serial recipe, which the app in sync mode equals step for step."""

import json
import logging
import math
import os
import re
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from apps.grpo.main import main
from damage import dcp_shard, truncate
from processes import actor_processes, children_left, run_killing_after_checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge.actors.generator import GeneratorConfig, build_generation_engine
from forge.config import load_config
from forge.engines.generation import SamplingParams
from forge.grpo.config import GRPOConfig
from forge.recipes.grpo_replay import load_replay_batches
from forge.recipes.grpo_serial import grpo_serial
from forge.rl.batch import PolicyBatch
from forge.rollout.records import batches_path, read_records
from forge.runs.restarts import ACTOR_FAILED_EXIT

pytestmark = pytest.mark.slow

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


def wait_for_rows(metrics: Path, count: int, timeout: float = 600) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= count:
            return True
        time.sleep(0.1)
    return False


def kill_one_generator_replica_and_stop_the_other(metrics: Path, faulted: list[int]) -> threading.Thread:
    """Once the first metrics row (step 0's eval) is written, while the first rollouts run:
    kills one of this run's two generator replicas and stops the other (SIGSTOP: alive,
    answering nothing). The run can go on only once both are replaced."""
    app_pid = os.getpid()

    def fault() -> None:
        if not wait_for_rows(metrics, 1):
            return
        replicas = actor_processes(app_pid, "Generator")[-2:]  # this run's two replicas
        if len(replicas) == 2:
            replicas[0].send_signal(signal.SIGKILL)
            replicas[1].send_signal(signal.SIGSTOP)
            faulted.extend(r.pid for r in replicas)

    thread = threading.Thread(target=fault, daemon=True)
    thread.start()
    return thread


def test_faults_cost_nothing_and_the_run_checkpoints_and_exports(
    write_grpo_config, tiny_policy, tmp_path, rewards_module
):
    """A hung reward, infinite rewards, a killed generator replica and a hung one, in one run,
    with the weights broadcast (gloo groups standing in for NCCL's): the transfers go on in new
    groups without the dead and the hung, and each replacement receives the newest version."""
    hang, inf = f"{rewards_module}:hangs_once", f"{rewards_module}:inf_on_even_length"
    config = write_grpo_config(
        reward=f"{{timeout_s: 1.0, functions: [{{name: toy_task}}, {{name: '{hang}', weight: 0.0}}, "
        f"{{name: '{inf}'}}]}}",
        checkpoint="{every: 2, keep: 1}",
    )
    run = tmp_path / "run"
    faulted: list[int] = []
    faults = kill_one_generator_replica_and_stop_the_other(run / "metrics.jsonl", faulted)
    liveness = ["generator.deadline.base_s=10", "generator.probe.every_s=1", "generator.probe.timeout_s=5"]
    history = main(
        [
            "--config",
            str(config),
            "replay_buffer.max_size=8",
            "generator.replicas=2",
            "generator.weight_transport=broadcast",
            "max_steps=5",
            *liveness,
        ]
    )
    faults.join(timeout=5)
    assert len(faulted) == 2, "the generator replicas were not both faulted"
    # The stopped replica missed a deadline or a probe: it was killed, not left stopped.
    assert not psutil.pid_exists(faulted[1]) or psutil.Process(faulted[1]).status() == psutil.STATUS_ZOMBIE
    # Shutdown stopped the service before its replicas: no replacement started as they stopped.
    assert children_left(15) == []
    rows = read_rows(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert [s for s, _ in history["eval_accuracy"]] == [0, 1, 2, 3, 4, 5]
    # The stopped replica was found hung (the killed one may be too: its death can be reported
    # after its probe times out).
    assert total(rows, "service/Generator/hung") >= 1

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


def test_a_lone_generator_that_hangs_stops_the_run_by_name_and_a_damaged_checkpoint_is_skipped(
    write_grpo_config, tmp_path, capsys, caplog
):
    """One generator (nothing to replace it) stopped by SIGSTOP: the next call to it (a generate,
    or a checkpoint's RNG query) misses its deadline, its process is killed, and the run stops
    naming it and the checkpoint. Then its newest checkpoint is damaged: the resume falls back to
    the one before, saying so; with none intact, a start-up error says so before any actor starts."""
    run = tmp_path / "run"
    config = write_grpo_config(checkpoint="{every: 1, keep: 2}")
    hung: list[int] = []

    def stop_the_generator() -> None:
        if wait_for_rows(run / "metrics.jsonl", 4):  # step 3 trained, steps 1 and 2 checkpointed
            [generator] = actor_processes(os.getpid(), "Generator")[-1:]
            generator.send_signal(signal.SIGSTOP)
            hung.append(generator.pid)

    thread = threading.Thread(target=stop_the_generator, daemon=True)
    thread.start()
    with pytest.raises(SystemExit) as stopped:
        # The deadline is what the run waits after the SIGSTOP: 5 s, many times what a call to
        # the tiny policy takes even on a loaded machine (the default, 600 s, is for real models).
        main(["--config", str(config), "max_steps=100", "generator.deadline.base_s=5"])
    thread.join(timeout=5)
    assert stopped.value.code == ACTOR_FAILED_EXIT and hung  # what max_restarts restarts
    err = capsys.readouterr().err
    assert re.search(r"error: actor Generator_\d+ hung: no answer to \w+\(\) within 5 s", err), err
    assert re.search(r"newest checkpoint: \S+/step_\d{8} \(continue with resume=true\)", err), err
    assert children_left(15) == []  # the stopped process was killed, the others stopped

    # At least steps 1 and 2 were checkpointed before the generator stopped (keep: 2 leaves the
    # last two).
    previous, newest = sorted((run / "checkpoints").iterdir())
    last = int(newest.name.removeprefix("step_"))
    truncate(dcp_shard(newest))
    with caplog.at_level(logging.WARNING, logger="forge.runs.checkpoint"):
        main(["--config", str(config), "resume=true", f"max_steps={last + 1}"])
    assert (
        f"resume: continuing after step {int(previous.name.removeprefix('step_'))}" in capsys.readouterr().out
    )
    assert any(str(newest) in r.getMessage() and "damaged" in r.getMessage() for r in caplog.records)
    assert [r["step"] for r in read_rows(run / "metrics.jsonl")] == list(range(last + 2))
    for checkpoint in (run / "checkpoints").iterdir():
        truncate(checkpoint / "run_state.pt")
    with pytest.raises(SystemExit) as refused:
        main(["--config", str(config), "resume=true", f"max_steps={last + 3}"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "error: " in err and "no intact checkpoint to resume from" in err
    assert f"step_{last + 1:08d}: run_state.pt" in err


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
    # The critic's: its loss and values on the trained batch, after the restart from its
    # checkpointed weights and optimizer state too.
    "critic/value_loss",
    "critic/values",
    "critic/grad_norm",
)
# PPO's advantages (GAE over a critic's values, with the KL penalty in the token rewards) and a
# teacher (distill) adding its per-token term, in the app and in the recipe alike.
PPO_AND_TEACHER = [
    "rollout.advantage=gae",
    "rollout.kl_coef=0.05",
    "critic={optimizer: {lr: 0.003}, lam: 0.9}",
]


def test_a_killed_trainer_names_itself_and_the_restarted_run_equals_the_serial_recipe(
    write_grpo_config, tmp_path, rewards_module, tiny_teacher
):
    """With max_restarts 1, the invocation whose trainer is SIGKILLed after the step-2 checkpoint
    restarts the pipeline from it and finishes. The steps before the kill, and those after the
    restart, are the serial recipe's numbers: the pipeline is the recipe, and a restart loses or
    repeats nothing. The run has a critic (PPO's GAE advantages) and a teacher: the restarted
    pipeline restores the critic from the checkpoint and has its teacher again."""
    config = write_grpo_config(
        reward=f"{{functions: [{{name: '{rewards_module}:by_characters'}}]}}",
        distill=f"{{teacher_path: {tiny_teacher}, weight: 0.5}}",
    )
    serial = grpo_serial(load_config(GRPOConfig, config, [*SYNC, *PPO_AND_TEACHER]))
    expected = [{"step": 0, "eval/accuracy": serial["eval_accuracy"][0][1]}, *serial["metrics"]]

    killed = tmp_path / "killed"
    argv = [
        "--config",
        str(config),
        *SYNC,
        *PPO_AND_TEACHER,
        f"output_dir={killed}",
        f"metrics.jsonl_path={killed}/m.jsonl",
    ]
    returncode, output = run_killing_after_checkpoint(
        [*argv, "max_restarts=1", "restart_backoff_s=0"], killed, "TitanTrainer"
    )
    assert returncode == 0, output[-3000:]
    # Named by whichever comes first, the failed call or Monarch's report of the death; the
    # reason's wording varies ("Killed(sig=9)", or a timeout waiting for the dead process).
    assert re.search(r"error: actor TitanTrainer_\d+ died", output), output[-3000:]
    checkpoint = killed / "checkpoints" / "step_00000002"
    assert f"newest checkpoint: {checkpoint} (continue with resume=true)" in output
    assert f"restart 1 of 1 in 0 s, from {checkpoint}" in output
    assert "resume: continuing after step 2" in output
    resumed = read_rows(killed / "m.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]  # step 0 (the initial eval), no repeats, no gaps
    assert [r["run/restarts"] for r in resumed[1:]] == [0, 0, 1, 1]
    assert any("distill/reverse_kl" in r for r in resumed[3:])  # the restarted teacher scored
    # The critic trained every step from its zero head (values 0 at the first step), and the
    # checkpoints hold its state beside the trainer's.
    assert resumed[1]["critic/values"] == 0.0 and all(r["critic/values"] != 0.0 for r in resumed[2:])
    assert any("critic/explained_variance" in r for r in resumed)
    assert (killed / "checkpoints" / "step_00000004" / "critic").is_dir()
    # The trained advantages are GAE's per token; the batches carry the critic's values and the
    # returns, recorded for replay.
    [first_rank] = load_replay_batches(killed / "rollouts.jsonl")[-1]
    batch = PolicyBatch.from_episodes(first_rank, pad_id=0)
    assert batch.advantages.shape == batch.values.shape == batch.returns.shape == batch.loss_mask.shape
    assert batch.values.abs().sum() > 0 and batch.returns.abs().sum() > 0
    # The record files continue across the resume: one batch record per step, each of its
    # episodes recorded exactly once, records in step order (the killed run's after step 2 dropped).
    records = list(read_records(killed / "rollouts.jsonl"))
    batches = list(read_records(batches_path(killed / "rollouts.jsonl")))
    assert len(batches) == 4
    recorded = [r["episode_id"] for r in records if not r["eval"]]
    assert len(recorded) == len(set(recorded))
    assert all(i in set(recorded) for b in batches for rank in b["episode_ids"] for i in rank)
    steps = [r["step"] for r in records]
    # Step 5: rollouts that finished after the final checkpoint, while the run ended (recorded
    # as any rollout after a checkpoint is, under the next step); never an eval.
    assert steps == sorted(steps) and set(steps) <= {0, 1, 2, 3, 4, 5}
    assert not [r for r in records if r["step"] == 5 and r["eval"]]
    eval_steps = [r["step"] for r in records if r["eval"]]
    assert [eval_steps.count(step) for step in range(5)] == [8] * 5  # eval.num_prompts answers a step
    assert len({r["train/loss"] for r in expected[1:]}) == 4  # the comparison below is not of constants
    for want, got in zip(expected, resumed, strict=True):
        for key in COMPARED if want["step"] else ("eval/accuracy",):
            assert got[key] == want[key], (
                f"step {want['step']}: {key} {got[key]} != {want[key]} (serial recipe)"
            )
