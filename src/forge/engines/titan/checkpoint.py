"""Atomic training checkpoints with torch.distributed.checkpoint (DCP).

We call DCP directly rather than through torchtitan's ``CheckpointManager``: the manager saves
only on its own interval (its "last step" save keeps the model alone), writes straight into
``step-N`` and, when scanning, takes any name containing ``step-N`` (so a ``step-N.tmp`` could
not coexist with it), refuses ``keep_latest_k=1``, and on a missing folder falls back to its
initial-load settings. What we need is small: save now, write to ``step-N.tmp`` and rename when
complete, find the latest complete one.

Layout: ``<folder>/step-<N>/`` holds a DCP checkpoint (``.metadata`` plus shards) of the model,
optimizer, LR scheduler and a ``train_state`` (step and the caller's ``extra_state``).
"""

import contextlib
import io
import logging
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

logger = logging.getLogger(__name__)

_COMPLETE_NAME = re.compile(r"step-(\d+)")
_TMP_SUFFIX = ".tmp"


class TrainState(Stateful):
    """The engine's step counter and the caller's opaque ``extra_state`` (e.g. a data cursor).

    ``extra_state`` is pickled (our own checkpoints are trusted) into one blob, so any picklable
    value works. DCP keeps one copy of non-tensor values, so it must be the same on every rank.
    """

    def __init__(self, step: int = 0, extra_state: dict[str, Any] | None = None) -> None:
        self.step = step
        self.extra_state = extra_state if extra_state is not None else {}

    def state_dict(self) -> dict[str, Any]:
        blob = io.BytesIO()
        torch.save(self.extra_state, blob)
        return {"step": torch.tensor(self.step, dtype=torch.int64), "extra_state": blob}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        state_dict["extra_state"].seek(0)
        self.extra_state = torch.load(state_dict["extra_state"], weights_only=False)


class Checkpointer:
    """Saves and loads ``step-N`` checkpoints in ``folder``; every rank calls every method."""

    def __init__(self, folder: str | os.PathLike, keep_latest_k: int) -> None:
        self.folder = Path(folder)
        self.keep_latest_k = keep_latest_k

    def step_dir(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending. Complete: renamed from ``.tmp`` (which
        happens only after DCP returned) and holding DCP's ``.metadata``, which DCP writes last."""
        if not self.folder.is_dir():
            return []
        steps = []
        for entry in self.folder.iterdir():
            match = _COMPLETE_NAME.fullmatch(entry.name)
            if match and (entry / ".metadata").is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def latest_step(self) -> int | None:
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def save(self, step: int, states: dict[str, Any]) -> Path:
        final_dir = self.step_dir(step)
        tmp_dir = final_dir.with_name(final_dir.name + _TMP_SUFFIX)
        if dist.get_rank() == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            # Leftovers of a save that crashed; only this engine writes this folder.
            for leftover in self.folder.glob(f"step-*{_TMP_SUFFIX}"):
                shutil.rmtree(leftover)
        dist.barrier()
        save_dcp(states, tmp_dir)
        # DCP returns on every rank only after rank 0 wrote .metadata, so the data is complete.
        if dist.get_rank() == 0:
            if final_dir.exists():
                shutil.rmtree(final_dir)
            tmp_dir.rename(final_dir)
            _fsync_dir(self.folder)
            self._purge()
        dist.barrier()
        logger.info("saved checkpoint %s", final_dir)
        return final_dir

    def load(self, states: dict[str, Any], step: int | None = None) -> int:
        """Load ``step`` (default: the latest complete one) into ``states`` in place."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no complete checkpoint (step-N/.metadata) in {self.folder}")
        elif step not in self.complete_steps():
            raise FileNotFoundError(
                f"no complete checkpoint for step {step} in {self.folder}; "
                f"complete steps: {self.complete_steps()}"
            )
        load_dcp(states, self.step_dir(step))
        logger.info("loaded checkpoint %s", self.step_dir(step))
        return step

    def _purge(self) -> None:
        if self.keep_latest_k == 0:
            return
        for step in self.complete_steps()[: -self.keep_latest_k]:
            shutil.rmtree(self.step_dir(step))


def save_dcp(states: dict[str, Any], directory: str | os.PathLike) -> None:
    """Writes ``states`` as a DCP checkpoint into ``directory`` (every rank calls it). Not
    atomic by itself: the caller writes to a temporary name and renames."""
    with _single_process_warning_silenced():
        dcp.save(states, checkpoint_id=str(directory), no_dist=_single_process())


def load_dcp(states: dict[str, Any], directory: str | os.PathLike) -> None:
    """Loads the DCP checkpoint in ``directory`` into ``states`` in place (every rank calls it)."""
    if not (Path(directory) / ".metadata").is_file():
        raise FileNotFoundError(f"{directory} holds no complete DCP checkpoint (no .metadata)")
    with _single_process_warning_silenced():
        dcp.load(states, checkpoint_id=str(directory), no_dist=_single_process())


def _fsync_dir(path: Path) -> None:
    # Makes the rename itself durable, not only the files DCP already synced.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _single_process() -> bool:
    # With one rank DCP's collectives are pointless, and on CPU they cost more than that:
    # they run on gloo worker threads that start their own OpenMP teams, after which the
    # trainer's steps were about 3x slower for the rest of the run (2 threads, 2 cores).
    return dist.get_world_size() == 1


@contextlib.contextmanager
def _single_process_warning_silenced():
    # DCP warns that it "assumes the intent is to save in a single process": it is ours.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
