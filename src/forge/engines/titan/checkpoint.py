"""Training state in torch.distributed.checkpoint (DCP), loaded safely.

We call DCP directly rather than through torchtitan's ``CheckpointManager``: the manager saves
only on its own interval (its "last step" save keeps the model alone), writes straight into
``step-N`` with no temporary name, refuses ``keep_latest_k=1``, and on a missing folder falls
back to its initial-load settings. What a run needs is small: ``save_dcp`` the model,
optimizer, LR scheduler and a ``TrainState`` into a directory, ``load_dcp`` them back; a run
checkpoint (forge.runs.checkpoint) makes that directory part of an atomic, verified checkpoint.

Loading runs none of a checkpoint's code, so that a checkpoint from someone else is safe to
load: DCP itself unpickles ``.metadata`` and non-tensor values with plain pickle, which calls
whatever the file names; ``load_dcp`` reads them with allowlists instead (DCP's metadata
records; plain Python values, tensors and the ``BytesIO`` holding ``extra_state``).
"""

import contextlib
import io
import os
import pickle
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.stateful import Stateful


class TrainState(Stateful):
    """The engine's step counter and the caller's ``extra_state`` (e.g. a data cursor).

    ``extra_state`` is saved with ``torch.save`` into one blob and loaded with
    ``weights_only=True``: plain Python values (dicts, lists, tuples, str, numbers, None) and
    tensors only, checked when saving. DCP keeps one copy of non-tensor values, so it must be the
    same on every rank.
    """

    def __init__(self, step: int = 0, extra_state: dict[str, Any] | None = None) -> None:
        self.step = step
        self.extra_state = extra_state if extra_state is not None else {}

    def state_dict(self) -> dict[str, Any]:
        blob = io.BytesIO()
        torch.save(self.extra_state, blob)
        # Fails now, not at the resume: a value that loading would refuse.
        safe_load(blob, "the extra_state to save")
        return {"step": torch.tensor(self.step, dtype=torch.int64), "extra_state": blob}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.extra_state = safe_load(state_dict["extra_state"], "the checkpoint's extra_state")


class RefusedValue(ValueError):
    """A checkpoint's value that loading refuses: building it could run code, or it is unreadable."""


def safe_load(source: str | os.PathLike | io.BytesIO, what: str, allowed: Sequence[type] = ()) -> Any:
    """``torch.load`` that runs none of the file's code: it builds plain Python values, tensors
    and the ``allowed`` classes only (classes whose building runs no code, e.g. plain
    dataclasses). Refused or unreadable: ``RefusedValue`` naming ``what``."""
    if isinstance(source, io.BytesIO):
        source.seek(0)
    with torch.serialization.safe_globals(list(allowed)):
        try:
            return torch.load(source, weights_only=True)
        except pickle.UnpicklingError as e:
            kinds = ["plain Python values", "tensors", *(c.__name__ for c in allowed)]
            kinds = ", ".join(kinds[:-1]) + " and " + kinds[-1]
            raise RefusedValue(
                f"{what} holds a value other than {kinds}, refused since building it could run "
                f"code ({_refusal(e)})"
            ) from None
        except (RuntimeError, EOFError) as e:
            raise RefusedValue(f"{what} is unreadable, damaged ({e})") from None


def _refusal(error: pickle.UnpicklingError) -> str:
    # torch puts the reason ("Unsupported global: GLOBAL numpy...", "... GLOBAL posix.system
    # whose module posix is blocked") between advice to load with weights_only=False, which
    # would run the file's code, and a link to its docs: keep the reason alone.
    lines = [line for line in str(error).splitlines() if "GLOBAL" in line or "Unsupported" in line]
    return " ".join(lines) or str(error)


def save_dcp(states: dict[str, Any], directory: str | os.PathLike) -> None:
    """Writes ``states`` as a DCP checkpoint into ``directory`` (every rank calls it). Not
    atomic by itself: the caller writes to a temporary name and renames."""
    with _single_process_warning_silenced():
        dcp.save(states, checkpoint_id=str(directory), no_dist=_single_process())


def load_dcp(states: dict[str, Any], directory: str | os.PathLike) -> None:
    """Loads the DCP checkpoint in ``directory`` into ``states`` in place (every rank calls it).
    A value that could run code is refused (``RefusedValue`` naming it and ``directory``)."""
    metadata_path = Path(directory) / ".metadata"
    if not metadata_path.is_file():
        raise FileNotFoundError(f"{directory} holds no complete DCP checkpoint (no .metadata)")
    reader = _SafeReader(directory, _read_metadata(metadata_path))
    with _single_process_warning_silenced():
        try:
            dcp.load(states, storage_reader=reader, planner=_SafeLoadPlanner(), no_dist=_single_process())
        except CheckpointException as e:
            # DCP wraps each rank's failure in a report of tracebacks: a refusal reads better alone.
            refused = [error for error, _ in e.failures.values() if isinstance(error, RefusedValue)]
            if not refused:
                raise
            raise RefusedValue(f"{directory}: {refused[0]}") from None
        except RefusedValue as e:  # TrainState's extra_state: loaded after DCP's own steps
            raise RefusedValue(f"{directory}: {e}") from None


# What DCP's ``.metadata`` pickle names: its metadata records, tensor properties and the
# checkpoint's path. A name outside these (and torch's dtypes) is refused, never looked up.
_METADATA_GLOBALS = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "StorageMeta",
            "MetadataIndex",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
}


class _ForbiddenGlobal(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise _ForbiddenGlobal(f"it names {module}.{name}")


def _read_metadata(path: Path) -> dcp_metadata.Metadata:
    with open(path, "rb") as f:
        try:
            return _MetadataUnpickler(f).load()
        except _ForbiddenGlobal as e:
            raise RefusedValue(
                f"{path} holds a value other than DCP's metadata records, refused since building it "
                f"could run code ({e})"
            ) from None
        except (pickle.UnpicklingError, EOFError) as e:
            raise RefusedValue(f"{path} is unreadable, damaged ({e})") from None


class _SafeReader(FileSystemReader):
    """DCP's file reader, given the metadata that ``_read_metadata`` read (``FileSystemReader``
    reads it with ``pickle.load``, which calls whatever the file names)."""

    def __init__(self, directory: str | os.PathLike, metadata: dcp_metadata.Metadata) -> None:
        super().__init__(directory)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        # As FileSystemReader.read_metadata does after its pickle.load.
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = dcp_metadata.StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner with non-tensor values loaded by ``safe_load`` (the default planner's
    ``load_bytes`` passes ``weights_only=False``). ``io.BytesIO`` is allowed: it is what
    ``TrainState`` stores ``extra_state`` in, and building one runs no code."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = safe_load(value, f"the DCP value {read_item.dest_index.fqn}", [io.BytesIO])
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


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
