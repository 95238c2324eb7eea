"""Checksums of a checkpoint's files, so that a damaged checkpoint is found before it is loaded.

``manifest.json`` in a checkpoint directory lists every other file under it (relative paths)
with its size and SHA-256. It is written last, into the checkpoint's temporary directory, so
the rename that completes a checkpoint also makes its manifest visible.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST_FILE = "manifest.json"


def write_manifest(directory: Path) -> None:
    """Records the size and SHA-256 of every file under `directory` in its manifest."""
    files = {
        path.relative_to(directory).as_posix(): {"size": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != MANIFEST_FILE
    }
    with open(directory / MANIFEST_FILE, "w", encoding="utf-8") as f:
        json.dump({"files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def find_damage(directory: Path) -> str | None:
    """How `directory`'s files differ from its manifest (the first difference found: a file
    missing, of another size, or with other bytes), or None when they all match."""
    try:
        listed = json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8"))["files"]
        expected = {name: (int(entry["size"]), str(entry["sha256"])) for name, entry in listed.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its {MANIFEST_FILE} is unreadable ({type(e).__name__}: {e})"
    # Sizes first: a truncated file is found without reading the others.
    for name, (size, _) in sorted(expected.items()):
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} when it was written"
    for name, (_, sha256) in sorted(expected.items()):
        if _sha256(directory / name) != sha256:
            return f"{name} changed since it was written (its SHA-256 differs)"
    return None


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
