"""Run checkpoints are safe and self-checking: loading one runs none of its code (a crafted
run state, trainer extra state, DCP value or DCP metadata is refused, naming it), and a
damaged newest checkpoint is skipped, with a warning naming it, for the newest intact one.

The checkpointer is driven with stand-ins for the actors' endpoints over the real state
objects (a DCP checkpoint, the episode buffer, the prompt cursor). The GRPO app's own resume
from the checkpoint before a damaged newest one: tests/grpo/test_grpo_durable.py."""

import asyncio
import io
import logging
import os
import pickle
import random
import re
import shlex
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from damage import dcp_shard, flip_a_bit, truncate

from forge.data.prompts import PromptCursor
from forge.data.types import Completion, Episode, Turn
from forge.engines.titan.checkpoint import TrainState, load_dcp, save_dcp
from forge.replay_buffer import EpisodeBuffer, ReplayBufferConfig
from forge.runs import checkpoint as run_checkpoint
from forge.runs.checkpoint import Progress, RunActors, RunCheckpointer
from forge.runs.manifest import find_damage, write_manifest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _process_group():
    """DCP needs a process group: one of one rank, dropped for the next modules."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


class Endpoint:
    """An actor endpoint's `route` and `route_within`, in this process."""

    def __init__(self, fn):
        self.fn = fn

    async def route(self, *args):
        return self.fn(*args)

    async def route_within(self, seconds, *args):
        return self.fn(*args)


class Trainer:
    """The trainer's checkpoint endpoints, over a real DCP checkpoint of a weight and the step."""

    def __init__(self):
        self.state = {"weight": torch.zeros(1024), "step": torch.tensor(0)}
        self.save_to = Endpoint(lambda directory: save_dcp(self.state, directory))
        self.load_from = Endpoint(self._load_from)

    def _load_from(self, directory: str) -> int:
        load_dcp(self.state, directory)
        return int(self.state["step"])


def stateful(obj) -> SimpleNamespace:
    """An actor's `state_dict` and `load_state_dict` endpoints over `obj` (kept as `.obj`)."""
    return SimpleNamespace(
        obj=obj, state_dict=Endpoint(obj.state_dict), load_state_dict=Endpoint(obj.load_state_dict)
    )


def make_actors() -> RunActors:
    buffer = EpisodeBuffer(ReplayBufferConfig(batch_size=2, seed=1))
    cursor = PromptCursor([{"prompt": f"{i}+1=", "target": str(i + 1)} for i in range(10)], seed=2)
    rng = {"python": random.Random(3).getstate(), "torch": torch.Generator().manual_seed(4).get_state()}
    generator = SimpleNamespace(
        rng=rng,
        rng_state=Endpoint(lambda: rng),
        load_rng_state=Endpoint(rng.update),
        replaces_failed_replicas=False,  # a lone generator: its RNG is checkpointed
    )
    return RunActors(Trainer(), stateful(buffer), stateful(cursor), generator)


def episode(version: int, reward: float = 0.5) -> Episode:
    completion = Completion(
        "1+1=",
        [5, 6],
        [7, 8, 9],
        [-0.25, -1.5, -0.125],
        "2",
        "stop",
        version,
        response_mask=[1, 0, 1],
        token_versions=[version, version, version],
        turns=[Turn("assistant", "2", 1, 0.5), Turn("tool", "ok", 1), Turn("assistant", "", 1)],
    )
    return Episode(
        completion, "2", "g", reward, {"toy": reward}, 0.25, ref_logprobs=[-0.5] * 3, episode_id=f"e{version}"
    )


async def train_and_save(checkpoints: RunCheckpointer, actors: RunActors, step: int) -> Path:
    """Changes every actor's state as training to `step` would, then checkpoints it."""
    actors.trainer.state["weight"].fill_(float(step))
    actors.trainer.state["step"].fill_(step)
    actors.replay_buffer.obj.add(episode(step))
    for _ in range(3):
        actors.dataset.obj.next()
    actors.generator.rng.update(
        python=random.Random(step).getstate(), torch=torch.Generator().manual_seed(step).get_state()
    )
    return await checkpoints.save(Progress(step, step, {"eval_accuracy": [(step, 0.25)]}), actors)


def two_checkpoints(root: Path) -> tuple[RunCheckpointer, list[Path]]:
    checkpoints, actors = RunCheckpointer(root, keep=2), make_actors()

    async def save():
        return [await train_and_save(checkpoints, actors, step) for step in (2, 4)]

    return checkpoints, asyncio.run(save())


async def resumed(checkpoints: RunCheckpointer, actors: RunActors) -> Progress:
    """`checkpoints.resume` into `actors`, with nothing to publish the weights to."""

    async def publish(version: int) -> None:
        pass

    return await checkpoints.resume(actors, publish, None)


def resume(checkpoints: RunCheckpointer) -> tuple[Progress, RunActors]:
    actors = make_actors()
    return asyncio.run(resumed(checkpoints, actors)), actors


def test_a_resumed_checkpoint_holds_what_was_saved(tmp_path):
    saved = make_actors()
    python_state, torch_state = random.getstate(), torch.get_rng_state()
    asyncio.run(train_and_save(RunCheckpointer(tmp_path, keep=2), saved, 2))
    random.seed(99)
    torch.manual_seed(99)
    progress, resumed = resume(RunCheckpointer(tmp_path, keep=2))
    assert (progress.step, progress.version, progress.history) == (2, 2, {"eval_accuracy": [(2, 0.25)]})
    assert progress.buffered_versions == [2]
    assert random.getstate() == python_state and torch.equal(torch.get_rng_state(), torch_state)
    assert resumed.generator.rng["python"] == saved.generator.rng["python"]
    assert torch.equal(resumed.generator.rng["torch"], saved.generator.rng["torch"])
    assert torch.equal(resumed.trainer.state["weight"], torch.full((1024,), 2.0))
    assert resumed.replay_buffer.obj.state_dict() == saved.replay_buffer.obj.state_dict()
    assert resumed.replay_buffer.obj.state_dict()["episodes"] == [episode(2)]
    assert resumed.dataset.obj.state_dict() == saved.dataset.obj.state_dict()


def loop_runs_during(monkeypatch, name: str, work):
    """Runs `work()` (a coroutine) with forge.runs.checkpoint's `name` (a file check) made to wait
    for the event loop to run a step first: on the loop's own thread it would wait in vain.
    Returns work's result and whether the loop ran meanwhile."""
    real = getattr(run_checkpoint, name)
    checking, loop_ran = threading.Event(), threading.Event()
    waited = []

    def once_the_loop_ran(*args):
        checking.set()
        waited.append(loop_ran.wait(timeout=20))
        return real(*args)

    monkeypatch.setattr(run_checkpoint, name, once_the_loop_ran)

    async def while_ticking():
        task = asyncio.create_task(work())
        while not task.done():
            if checking.is_set():
                loop_ran.set()
            await asyncio.sleep(0.01)
        return await task

    return asyncio.run(while_ticking()), waited == [True]


def test_the_event_loop_goes_on_while_a_checkpoint_is_written_or_checked(tmp_path, monkeypatch):
    """At 8B a checkpoint's files are ~98 GB, whose SHA-256 takes about a minute, both for the
    manifest a save writes and for the check a resume makes: the controller's loop must go on
    meanwhile (an idle generator's liveness probe times out after 60 s)."""
    checkpoints = RunCheckpointer(tmp_path, keep=2)

    async def save():
        return await train_and_save(checkpoints, make_actors(), 2)

    saved, loop_ran = loop_runs_during(monkeypatch, "write_manifest", save)
    assert loop_ran, "the loop did not run while the manifest was written"
    assert saved.name == "step_00000002" and find_damage(saved) is None

    progress, loop_ran = loop_runs_during(
        monkeypatch, "find_damage", lambda: resumed(checkpoints, make_actors())
    )
    assert loop_ran, "the loop did not run while the checkpoint was checked"
    assert progress.step == 2


def test_a_critic_is_saved_and_restored_beside_the_trainer_and_its_absence_is_named(tmp_path):
    """With a critic (PPO), the checkpoint holds its state in critic/, and a resume restores it;
    a checkpoint written without one cannot resume a run that has one (it names what to do)."""
    saved = make_actors()
    saved.critic = Trainer()
    saved.critic.state["weight"].fill_(7.0)
    saved.critic.state["step"].fill_(2)
    checkpoint = asyncio.run(train_and_save(RunCheckpointer(tmp_path / "a", keep=2), saved, 2))
    assert (checkpoint / "critic" / ".metadata").is_file()
    resumed = make_actors()
    resumed.critic = Trainer()
    progress = asyncio.run(RunCheckpointer(tmp_path / "a", keep=2).restore(checkpoint, resumed))
    assert progress.step == 2 and torch.equal(resumed.critic.state["weight"], torch.full((1024,), 7.0))

    without = asyncio.run(train_and_save(RunCheckpointer(tmp_path / "b", keep=2), make_actors(), 2))
    with pytest.raises(ValueError, match="has no critic/ \\(it was saved by a run without a critic\\)"):
        asyncio.run(RunCheckpointer(tmp_path / "b", keep=2).restore(without, resumed))


DAMAGE = {
    "truncated run state": (lambda c: truncate(c / "run_state.pt"), "run_state.pt has"),
    "bit flip in a DCP shard": (lambda c: flip_a_bit(dcp_shard(c)), "changed since it was written"),
    "DCP metadata missing": (
        lambda c: (c / "trainer" / ".metadata").unlink(),
        "trainer/.metadata is missing",
    ),
    "manifest damaged": (lambda c: truncate(c / "manifest.json"), "its manifest.json is unreadable"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path, caplog, damage):
    checkpoints, [older, newest] = two_checkpoints(tmp_path)
    damage_fn, described = DAMAGE[damage]
    damage_fn(newest)
    checkpoints.check_start(resume=True)  # an intact one is left: the run may start
    with caplog.at_level(logging.WARNING, logger="forge.runs.checkpoint"):
        progress, actors = resume(checkpoints)
    assert progress.step == 2
    assert torch.equal(actors.trainer.state["weight"], torch.full((1024,), 2.0))
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert str(newest) in warning and described in warning and "skipped" in warning


def test_with_every_checkpoint_damaged_resume_names_each_and_what_to_do(tmp_path):
    checkpoints, [older, newest] = two_checkpoints(tmp_path)
    truncate(older / "run_state.pt")
    flip_a_bit(dcp_shard(newest))
    for attempt in (lambda: checkpoints.check_start(resume=True), lambda: resume(checkpoints)):
        with pytest.raises(ValueError) as error:
            attempt()
        message = str(error.value)
        assert "no intact checkpoint to resume from" in message
        assert "step_00000002: run_state.pt has" in message
        assert f"step_00000004: trainer/{dcp_shard(newest).name} changed" in message
        assert "another output_dir" in message


def test_a_checkpoint_without_a_manifest_is_resumed_unverified_with_a_warning(tmp_path, caplog):
    checkpoints, [older, newest] = two_checkpoints(tmp_path)
    (newest / "manifest.json").unlink()  # as a forge from before checksums wrote it
    with caplog.at_level(logging.WARNING, logger="forge.runs.checkpoint"):
        progress, _ = resume(checkpoints)
    assert progress.step == 4
    assert any(str(newest) in r.getMessage() and "unverified" in r.getMessage() for r in caplog.records)


class RunsCode:
    """What a crafted checkpoint holds: unpickling it runs a shell command (creates `marker`)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def test_a_crafted_run_state_is_refused_and_runs_nothing(tmp_path):
    checkpoints, [_, newest] = two_checkpoints(tmp_path / "checkpoints")
    marker = tmp_path / "MARKER"
    torch.save({"step": 4, "replay_buffer": RunsCode(marker)}, newest / "run_state.pt")
    write_manifest(newest)  # a consistent checkpoint: refused for what it holds, not as damaged
    with pytest.raises(ValueError) as error:
        resume(checkpoints)
    assert str(newest / "run_state.pt") in str(error.value) and "posix.system" in str(error.value)
    assert not marker.exists()
    torch.load(newest / "run_state.pt", weights_only=False)  # what loading it used to do
    assert marker.exists()


def refused(directory: Path, what: str) -> str:
    return re.escape(f"{directory}: {what}") + ".*posix.system"


def test_crafted_trainer_state_is_refused_and_runs_nothing(tmp_path):
    """The trainer's extra state, any other DCP value and DCP's own metadata file."""
    marker = tmp_path / "MARKER"
    crafted = io.BytesIO()
    torch.save({"cursor": RunsCode(marker)}, crafted)
    extra = tmp_path / "extra_state"
    save_dcp({"train_state": {"step": torch.tensor(1), "extra_state": crafted}}, extra)
    with pytest.raises(ValueError, match=refused(extra, "the checkpoint's extra_state holds")):
        load_dcp({"train_state": TrainState()}, extra)

    value = tmp_path / "value"
    save_dcp({"optimizer": {"lr": RunsCode(marker)}}, value)
    with pytest.raises(ValueError, match=refused(value, "the DCP value optimizer.lr holds")):
        load_dcp({"optimizer": {"lr": 0.0}}, value)

    metadata = tmp_path / "metadata"
    save_dcp({"weight": torch.zeros(4)}, metadata)
    (metadata / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(
        ValueError, match=re.escape(f"{metadata / '.metadata'} holds a value other") + ".*posix.system"
    ):
        load_dcp({"weight": torch.zeros(4)}, metadata)
    assert not marker.exists()


def test_state_that_a_resume_would_refuse_is_refused_when_saved(tmp_path):
    checkpoints, actors = RunCheckpointer(tmp_path, keep=2), make_actors()
    actors.replay_buffer.obj.add(episode(1, reward=np.float64(0.5)))
    with pytest.raises(ValueError, match="the run state to save holds a value .*numpy"):
        asyncio.run(checkpoints.save(Progress(1, 1), actors))
    assert checkpoints.complete() == []
    with pytest.raises(ValueError, match="extra_state to save holds .*numpy"):
        TrainState(1, {"seed": np.int64(3)}).state_dict()
