"""Where a run writes: refused before start-up when it cannot be written, and a run that fills
its disk (or finds it read-only) mid-way stops naming the file, so that it can be resumed
once there is room, instead of ending in a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from forge.runs.errors import RunStopped

# No space, a read-only file system, a disk quota: the run's own code is fine, its disk is not.
STORAGE_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EDQUOT)


def check_writable_dir(path: str | Path, key: str) -> None:
    """Creates the directory at ``path`` (config key ``key``) and writes a file into it, so that
    a folder the run could not create, or could not write to, fails before any process starts
    instead of after the actors have spent minutes starting. Raises ValueError naming both."""
    directory = Path(path)
    probe = directory / f".forge-write-probe-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        try:
            with open(probe, "wb") as f:
                f.write(b"forge")
                os.fsync(f.fileno())  # a full disk may accept the write and fail only here
        finally:
            with contextlib.suppress(FileNotFoundError):  # it could not be created
                probe.unlink()
    except OSError as error:
        raise ValueError(
            f"{key}: cannot write to {directory} ({error.strerror or error}): make it writable or "
            f"free space on its disk, then start again (add resume=true if it holds this run's "
            f"checkpoints), or choose another {key}"
        ) from None


def storage_error(error: BaseException) -> OSError | None:
    """The OSError of a full or read-only disk that caused ``error`` (itself, or a cause of it:
    a background writer re-raises its failure wrapped), else None."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in STORAGE_ERRNOS:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


@contextlib.contextmanager
def stop_on_storage_errors(output_dir: str | Path) -> Iterator[None]:
    """Turns a full or read-only disk met inside the block into a `RunStopped` naming the file
    (or ``output_dir``, for a write whose error names none): the app then names the newest
    checkpoint to resume from."""
    try:
        yield
    except RunStopped:
        raise  # it says why the run stopped already (an ActorFailed must stay one: it restarts)
    except Exception as error:
        failed = storage_error(error)
        if failed is None:
            raise
        what = failed.filename or f"the run's files in {output_dir}"
        raise RunStopped(
            f"cannot write {what}: {failed.strerror}. Free space on that disk (or make it writable), "
            "then resume the run"
        ) from error
