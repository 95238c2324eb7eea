"""Run checkpoints: everything a GRPO run needs to continue, complete or absent.

Layout under ``output_dir/checkpoints``::

    step_00000010/trainer/      the trainer's DCP checkpoint (model, optimizer, LR schedule, step)
    step_00000010/run_state.pt  replay buffer (episodes, RNG, counts), dataset cursor, the RNG
                                states of the controller and the generator, weight version,
                                metric step, eval history

A checkpoint is written as ``step_XXXXXXXX.tmp`` and renamed when both parts are on disk, so
a run killed while saving leaves no directory that looks complete. Only the newest
``keep`` are kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field

from forge.config import ForgeConfigModel
from forge.observability.backends import drop_metrics_after

logger = logging.getLogger(__name__)

STATE_FILE = "run_state.pt"
TRAINER_DIR = "trainer"
_COMPLETE_NAME = re.compile(r"step_(\d{8})")
_TMP_SUFFIX = ".tmp"


class CheckpointConfig(ForgeConfigModel):
    every: int = Field(50, ge=0, description="save every N steps and at the last (0: never)")
    keep: int = Field(2, ge=1, description="newest checkpoints kept on disk")
    # The final policy is always exported to output_dir/export; this also exports every N steps.
    export_every: int = Field(0, ge=0, description="also export every N steps (0: only at the end)")
    # The exported weights' dtype; None keeps the starting checkpoint's (its config.json's).
    export_dtype: Literal["float32", "bfloat16", "float16"] | None = None


@dataclass
class Progress:
    """What the training loop carries from step to step, checkpointed with the actors' state."""

    step: int = 0
    version: int = 0
    history: dict[str, list] = field(default_factory=lambda: {"eval_accuracy": []})
    # On restore: the policy versions of the episodes the buffer holds again.
    buffered_versions: list[int] = field(default_factory=list)


@dataclass
class RunActors:
    """The actors whose state a checkpoint holds (the generator for its RNG, when it is one actor)."""

    trainer: Any
    replay_buffer: Any
    dataset: Any
    generator: Any


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


def _rank0(value_mesh) -> Any:
    return next(iter(value_mesh.values()))


class RunCheckpointer:
    def __init__(self, root: str | os.PathLike, keep: int):
        self.root = Path(root)
        self.keep = keep

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [
            (int(m.group(1)), p)
            for p in self.root.iterdir()
            if (m := _COMPLETE_NAME.fullmatch(p.name)) and (p / STATE_FILE).is_file()
        ]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        complete = self.complete()
        return complete[-1] if complete else None

    def check_start(self, resume: bool) -> None:
        """A run that does not resume must not mix its checkpoints with another run's."""
        existing = self.complete()
        if existing and not resume:
            raise ValueError(
                f"{self.root} already holds checkpoints (newest: {existing[-1].name}): pass resume=true "
                "to continue that run, or choose another output_dir"
            )

    async def save(self, progress: Progress, actors: RunActors) -> Path:
        final = self.root / f"step_{progress.step:08d}"
        tmp = final.with_name(final.name + _TMP_SUFFIX)
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in self.root.glob(f"step_*{_TMP_SUFFIX}"):  # of a save that was killed
            shutil.rmtree(leftover)
        tmp.mkdir()
        await actors.trainer.save_to.call(str((tmp / TRAINER_DIR).resolve()))
        state = {
            "step": progress.step,
            "version": progress.version,
            "history": progress.history,
            "replay_buffer": await actors.replay_buffer.state_dict.call_one(),
            "dataset": await actors.dataset.state_dict.call_one(),
            "rng": {
                "controller": {"python": random.getstate(), "torch": torch.get_rng_state()},
                "generator": await _generator_rng(actors.generator),
            },
        }
        with open(tmp / STATE_FILE, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync_dir(self.root)
        for old in self.complete()[: -self.keep]:
            shutil.rmtree(old)
        logger.info("saved run checkpoint %s", final)
        return final

    async def restore(self, path: Path, actors: RunActors) -> Progress:
        """Puts every actor back in the state of checkpoint `path`; returns the loop's progress.
        The trainer's weights still have to be published (as `progress.version`)."""
        state = torch.load(path / STATE_FILE, weights_only=False)  # our own file: trusted
        trainer_step = _rank0(await actors.trainer.load_from.call(str((path / TRAINER_DIR).resolve())))
        if trainer_step != state["step"]:
            raise ValueError(
                f"{path}: the trainer is at step {trainer_step}, the run state at {state['step']}"
            )
        await actors.replay_buffer.load_state_dict.call_one(state["replay_buffer"])
        await actors.dataset.load_state_dict.call_one(state["dataset"])
        random.setstate(state["rng"]["controller"]["python"])
        torch.set_rng_state(state["rng"]["controller"]["torch"])
        if state["rng"]["generator"] is not None and not _is_service(actors.generator):
            await actors.generator.load_rng_state.call_one(state["rng"]["generator"])
        buffered = [episode.policy_version for episode in state["replay_buffer"]["episodes"]]
        return Progress(state["step"], state["version"], state["history"], buffered)

    async def resume(self, actors: RunActors, publish, metrics_path: str | None) -> Progress:
        """`restore` from the newest checkpoint (a fresh `Progress` when there is none), then
        `publish(version)` of the restored weights; drops the metric rows logged after it."""
        latest = self.latest()
        if latest is None:
            return Progress()
        progress = await self.restore(latest, actors)
        await publish(progress.version)
        if metrics_path:
            drop_metrics_after(Path(metrics_path), progress.step)
        logger.info("resumed from %s", latest)
        return progress


def _is_service(handle) -> bool:
    from forge.controller import Service

    return isinstance(handle, Service)


async def _generator_rng(generator) -> dict | None:
    # Replicas each have their own generator state and requests go to any of them: only a
    # lone generator's RNG can be put back meaningfully.
    return None if _is_service(generator) else await generator.rng_state.call_one()


def _fsync_dir(path: Path) -> None:
    # Makes the rename itself durable, not only the files.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
