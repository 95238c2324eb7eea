"""The append-only JSONL files of a run (metrics, rollout records, batch records): written by
appending, read back whatever a kill or a full disk left, trimmed on resume.

- ``JsonlAppender`` appends lines and flushes each write. A resumed run drops the rows written
  after its checkpoint by renaming a new file over the old one (``keep_rows``); the appender
  notices the rename and writes to the file now at its path.
- ``read_jsonl`` yields the rows. A last line that is not a complete JSON object (a process
  killed mid-write, a full disk) is skipped with a warning naming the file and line; a bad line
  anywhere else is an error naming them.
- ``keep_rows(path, keep)`` rewrites the file, in one rename, with the rows ``keep`` accepts:
  a resume from the checkpoint of step s keeps the rows of steps up to s, and the run appends
  the later ones again. What was written before the checkpoint is never lost.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class JsonlAppender:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def write_lines(self, text: str) -> None:
        """Appends ``text`` (whole lines, each ending in a newline) and flushes it."""
        if self._file.closed or self._replaced():
            self._file.close()
            self._file = self.path.open("a", encoding="utf-8")
        try:
            self._file.write(text)
            self._file.flush()
        except OSError as error:
            # A full disk. Closing drops what the buffer still holds, so that `close` does not
            # fail again (the next write reopens the file); a write's error names no file: name it.
            with contextlib.suppress(OSError):
                self._file.close()
            raise OSError(error.errno, error.strerror, str(self.path)) from error

    def write(self, row: dict[str, Any]) -> None:
        self.write_lines(json.dumps(row) + "\n")

    def _replaced(self) -> bool:
        try:
            return os.stat(self.path).st_ino != os.fstat(self._file.fileno()).st_ino
        except FileNotFoundError:
            return True

    def close(self) -> None:
        self._file.close()


def read_jsonl(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """The rows of ``path`` (see the module docstring for a cut last line)."""
    with Path(path).open(encoding="utf-8", errors="strict") as f:
        lines = f.read().split("\n")
    # A file that ends with a newline splits into a last empty string: not a line.
    last = len(lines) - (1 if lines[-1] == "" else 0)
    for line_no, line in enumerate(lines[:last], start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if line_no == last:
                logger.warning("%s, line %d: cut short (a run stopped mid-write); skipped", path, line_no)
                return
            raise ValueError(f"{path}, line {line_no}: not a JSON object ({e.msg})") from None
        yield row


def keep_rows(path: str | os.PathLike, keep: Callable[[int, dict[str, Any]], bool]) -> int:
    """Rewrites ``path`` with the rows for which ``keep(index, row)`` is true (index from 0, in
    file order), in one rename; a cut last line goes too. Returns the rows dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    rows = list(read_jsonl(path))
    kept = [row for index, row in enumerate(rows) if keep(index, row)]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in kept), encoding="utf-8")
    tmp.replace(path)
    return len(rows) - len(kept)
