"""Run checkpoints: everything a run (GRPO or SFT) needs to continue, complete or absent.

Layout under ``output_dir/checkpoints`` (SFT: ``run_dir/checkpoints``)::

    step_00000010/trainer/       the trainer's DCP checkpoint (model, optimizer, LR schedule, step)
    step_00000010/critic/        the critic's, likewise (GRPO with a critic only)
    step_00000010/run_state.pt   the step and the run's own state: GRPO's replay buffer (episodes,
                                 RNG, counts), dataset cursor, the RNG states of the controller and
                                 the generator, weight version, metric step, eval history; SFT's
                                 data loader position and the controller's RNG states
    step_00000010/manifest.json  size and SHA-256 of every other file (forge.runs.manifest)

A checkpoint is written as ``step_XXXXXXXX.tmp``, its manifest last, and renamed when all of
it is on disk, so a run killed while saving leaves no directory that looks complete. Only the
newest ``keep`` are kept. `RunCheckpointer.write` and `read` do this for any run state;
`save`, `restore` and `resume` gather and put back GRPO's (SFT's: forge.recipes.sft).

Resuming runs none of a checkpoint's code, so that resuming from a run directory someone else
wrote is safe: ``run_state.pt`` is loaded with ``torch.load(weights_only=True)``, which builds
plain Python values and tensors, plus forge's episode records (plain dataclasses); the trainer
loads its part the same way (forge.engines.titan.checkpoint). A checkpoint whose files differ
from its manifest is skipped, with a warning naming it, for the newest intact one. One written
by a forge from before manifests (it has none) is loaded unverified, with a warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import Field

from forge.config import ForgeConfigModel
from forge.data.types import Completion, Episode, Turn
from forge.engines.titan.checkpoint import safe_load
from forge.observability.backends import drop_metrics_after
from forge.runs.manifest import MANIFEST_FILE, find_damage, write_manifest

logger = logging.getLogger(__name__)

STATE_FILE = "run_state.pt"
TRAINER_DIR = "trainer"
CRITIC_DIR = "critic"
_COMPLETE_NAME = re.compile(r"step_(\d{8})")
_TMP_SUFFIX = ".tmp"
# The classes a run state may hold besides plain Python values and tensors: the replay
# buffer's episodes. Plain dataclasses: building one runs none of the file's code.
_RUN_STATE_CLASSES = [Episode, Completion, Turn]


class CheckpointConfig(ForgeConfigModel):
    every: int = Field(50, ge=0, description="save every N steps and at the last (0: never)")
    keep: int = Field(2, ge=1, description="newest checkpoints kept on disk")

    def due(self, step: int, last: bool) -> bool:
        """Whether `step` saves a checkpoint (`last`: the run's final step)."""
        return self.every > 0 and (last or step % self.every == 0)


@dataclass
class Progress:
    """What the training loop carries from step to step, checkpointed with the actors' state."""

    step: int = 0
    version: int = 0
    history: dict[str, list] = field(default_factory=lambda: {"eval_accuracy": []})
    # On restore: the policy versions of the episodes the buffer holds again.
    buffered_versions: list[int] = field(default_factory=list)
    # Whether it came from a checkpoint (a resume with none starts at step 0).
    restored: bool = False

    @property
    def last_kept_step(self) -> int:
        """The last step whose metric rows and records a resume keeps: the checkpoint's, or
        none (-1) without one (they were logged by an attempt that saved nothing)."""
        return self.step if self.restored else -1


@dataclass
class RunActors:
    """The actors whose state a checkpoint holds (the generator for its RNG, when it is one actor)."""

    trainer: Any
    replay_buffer: Any
    dataset: Any
    generator: Any
    # A lone generator must answer within this (forge.controller.liveness), or the run stops.
    generator_deadline_s: float = 600.0
    # PPO's value model (forge.actors.critic), saved and restored beside the trainer; None: none.
    critic: Any = None


class RolloutPause:
    """Lets a checkpoint wait for the rollouts in flight and hold back new ones, so that the
    buffer and the dataset cursor it saves agree: no prompt was drawn whose group is missing
    from the buffer. Rollouts wait for buffer room before entering, never inside."""

    def __init__(self):
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._active = 0

    @contextlib.asynccontextmanager
    async def rollout(self):
        await self._open.wait()
        self._active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._active -= 1
            if not self._active:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def paused(self):
        self._open.clear()
        try:
            await self._idle.wait()
            yield
        finally:
            self._open.set()


class RunCheckpointer:
    def __init__(self, root: str | os.PathLike, keep: int):
        self.root = Path(root)
        self.keep = keep

    def complete(self) -> list[Path]:
        """Complete checkpoints (renamed from .tmp), oldest first. Whether their files are
        intact is `newest_intact`'s question."""
        if not self.root.is_dir():
            return []
        found = [
            (int(m.group(1)), p)
            for p in self.root.iterdir()
            if (m := _COMPLETE_NAME.fullmatch(p.name))
            and ((p / STATE_FILE).is_file() or (p / MANIFEST_FILE).is_file())
        ]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        complete = self.complete()
        return complete[-1] if complete else None

    def newest_intact(self, warn: bool = True) -> Path | None:
        """The newest complete checkpoint whose files match its manifest (None: no checkpoint).
        Damaged newer ones are skipped, each named in a warning when `warn`; with none intact,
        raises ValueError saying what is wrong with each."""
        damaged = []
        for path in reversed(self.complete()):
            if not (path / MANIFEST_FILE).is_file():
                if warn:
                    logger.warning(
                        "checkpoint %s has no %s (a forge from before checkpoint checksums wrote it): "
                        "loading it unverified",
                        path,
                        MANIFEST_FILE,
                    )
                return path
            damage = find_damage(path)
            if damage is None:
                return path
            damaged.append(f"{path.name}: {damage}")
            if warn:
                logger.warning("checkpoint %s is damaged (%s): skipped for an older one", path, damage)
        if damaged:
            raise ValueError(
                f"{self.root}: no intact checkpoint to resume from ({'; '.join(damaged)}): restore "
                "these checkpoints from a copy, or start the run again in another output_dir"
            )
        return None

    def check_start(self, resume: bool | str, dir_key: str = "output_dir") -> None:
        """A run that does not resume must not mix its checkpoints with another run's; one that
        does (`true`, or `auto`) needs an intact checkpoint when there are any, and with `true`
        at least one (checked before actors start, so that it fails in seconds; `resume`
        checks again what it loads)."""
        existing = self.complete()
        if existing and not resume:
            raise ValueError(
                f"{self.root} already holds checkpoints (newest: {existing[-1].name}): pass resume=true "
                f"to continue that run, or choose another {dir_key}"
            )
        if resume is True and not existing:
            raise ValueError(
                f"resume=true, but {self.root} holds no checkpoint to continue from: use resume=auto to "
                "continue when there is one and start otherwise, or leave resume out"
            )
        if resume:
            self.newest_intact(warn=False)

    async def save(self, progress: Progress, actors: RunActors) -> Path:
        state = {
            "step": progress.step,
            "version": progress.version,
            "history": progress.history,
            "replay_buffer": await actors.replay_buffer.state_dict.route(),
            "dataset": await actors.dataset.state_dict.route(),
            "rng": {"controller": controller_rng_state(), "generator": await _generator_rng(actors)},
        }
        return await self.write(actors.trainer, state, actors.critic)

    async def write(self, trainer: Any, state: dict[str, Any], critic: Any = None) -> Path:
        """Checkpoint ``state["step"]``: the trainer's state (its `save_to` endpoint), the
        critic's (where there is one) and the run's `state`, atomically, keeping the newest `keep`."""
        final = self.root / f"step_{state['step']:08d}"
        tmp = final.with_name(final.name + _TMP_SUFFIX)
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in self.root.glob(f"step_*{_TMP_SUFFIX}"):  # of a save that was killed
            shutil.rmtree(leftover)
        tmp.mkdir()
        await trainer.save_to.route(str((tmp / TRAINER_DIR).resolve()))
        if critic is not None:
            await critic.save_to.route(str((tmp / CRITIC_DIR).resolve()))
        # In a thread, so that the event loop goes on (liveness probes, metrics): at 8B the
        # trainer's files are ~98 GB, and their SHA-256 for the manifest takes about a minute.
        await asyncio.to_thread(self._complete, tmp, final, state)
        logger.info("saved run checkpoint %s", final)
        return final

    def _complete(self, tmp: Path, final: Path, state: dict[str, Any]) -> None:
        """Writes the run state and the manifest into `tmp`, renames it to `final`, and drops
        the checkpoints beyond the newest `keep`."""
        blob = io.BytesIO()
        torch.save(state, blob)
        # Fails now, not at the resume: a value that loading would refuse.
        safe_load(blob, "the run state to save", _RUN_STATE_CLASSES)
        with open(tmp / STATE_FILE, "wb") as f:
            f.write(blob.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        write_manifest(tmp)  # last: it covers every file above
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync_dir(self.root)
        for old in self.complete()[: -self.keep]:
            shutil.rmtree(old)

    async def read(self, path: Path, trainer: Any, critic: Any = None) -> dict[str, Any]:
        """Puts the trainer (and the critic, where there is one) back in the state of checkpoint
        `path` (their `load_from` endpoints); returns the run state `write` saved with it."""
        state = safe_load(path / STATE_FILE, str(path / STATE_FILE), _RUN_STATE_CLASSES)
        models = [("trainer", trainer, TRAINER_DIR)] + ([("critic", critic, CRITIC_DIR)] if critic else [])
        for name, model, directory in models:
            if not (path / directory).is_dir():
                raise ValueError(
                    f"{path} has no {directory}/ (it was saved by a run without a {name}): resume it "
                    f"with the config it was written with, or start afresh in another output_dir"
                )
            model_step = await model.load_from.route(str((path / directory).resolve()))
            if model_step != state["step"]:
                raise ValueError(
                    f"{path}: the {name} is at step {model_step}, the run state at {state['step']}"
                )
        return state

    async def restore(self, path: Path, actors: RunActors) -> Progress:
        """Puts every actor back in the state of checkpoint `path`; returns the loop's progress.
        The trainer's weights still have to be published (as `progress.version`)."""
        state = await self.read(path, actors.trainer, actors.critic)
        await actors.replay_buffer.load_state_dict.route(state["replay_buffer"])
        await actors.dataset.load_state_dict.route(state["dataset"])
        set_controller_rng_state(state["rng"]["controller"])
        if state["rng"]["generator"] is not None and not actors.generator.replaces_failed_replicas:
            await actors.generator.load_rng_state.route_within(
                actors.generator_deadline_s, state["rng"]["generator"]
            )
        buffered = [episode.policy_version for episode in state["replay_buffer"]["episodes"]]
        return Progress(state["step"], state["version"], state["history"], buffered, restored=True)

    async def resume(self, actors: RunActors, publish, metrics_path: str | None) -> Progress:
        """`restore` from the newest intact checkpoint (a fresh `Progress` when there is none),
        then `publish(version)` of the restored weights; drops the metric rows logged after it
        (all of them without a checkpoint: `Progress.last_kept_step`)."""
        # In a thread, as `write`'s manifest: checking it reads every byte of the checkpoint.
        path = await asyncio.to_thread(self.newest_intact)
        if path is None:
            progress = Progress()
        else:
            progress = await self.restore(path, actors)
            await publish(progress.version)
            logger.info("resumed from %s", path)
        if metrics_path:
            drop_metrics_after(Path(metrics_path), progress.last_kept_step)
        return progress


def controller_rng_state() -> dict[str, Any]:
    """This process's Python and torch RNG states, for a checkpoint."""
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def set_controller_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])


async def _generator_rng(actors: RunActors) -> dict | None:
    # Replicas each have their own generator state, requests go to any of them and a replacement
    # starts afresh: only a lone generator's RNG can be put back meaningfully.
    if actors.generator.replaces_failed_replicas:
        return None
    return await actors.generator.rng_state.route_within(actors.generator_deadline_s)


def _fsync_dir(path: Path) -> None:
    # Makes the rename itself durable, not only the files.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
