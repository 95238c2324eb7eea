"""Read one split of a dataset file (JSON, JSONL, Parquet), a local dataset folder or a Hub dataset:
the rows SFT trains on and GRPO draws prompts from."""

import json
import logging
from pathlib import Path

import datasets

logger = logging.getLogger(__name__)

# Local files are read by the `datasets` builder that matches their extension.
BUILDER_BY_EXTENSION = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def load_split(path: str, split: str) -> datasets.Dataset:
    """Load one split of a local JSON / JSONL / Parquet file, a local dataset folder, or a
    Hugging Face Hub dataset named ``hf://NAME`` (the Hub is consulted for those only).

    A local file has a single split named ``train``; ``split`` may still slice it, e.g.
    ``"train[:1000]"`` or ``"train[90%:]"``. A file that JSON cannot read is refused naming its
    first bad line.
    """
    if path.startswith("hf://"):
        return _loaded(path, split, datasets.load_dataset(path.removeprefix("hf://"), split=split))
    local = Path(path)
    if not local.exists():
        raise FileNotFoundError(
            f"{path}: no such file or folder; give a local JSON, JSONL or Parquet file, or hf://NAME "
            "for a dataset on the Hugging Face Hub"
        )
    if local.is_file():
        builder = BUILDER_BY_EXTENSION.get(local.suffix.lower())
        if builder is None:
            raise ValueError(
                f"{path}: unsupported file extension {local.suffix!r}; "
                f"expected one of {', '.join(sorted(BUILDER_BY_EXTENSION))}"
            )
        if local.stat().st_size == 0:
            # `datasets` fails on an empty file with an unrelated-looking StopIteration.
            raise ValueError(f"{path}: the file is empty: there is nothing to train on")
        if builder == "json":
            check_json_lines(local)
        return _loaded(path, split, datasets.load_dataset(builder, data_files=str(local), split=split))
    return _loaded(path, split, datasets.load_dataset(path, split=split))


def _loaded(path: str, split: str, dataset: datasets.Dataset) -> datasets.Dataset:
    logger.info("loaded %s split %r: %d rows, columns %s", path, split, len(dataset), dataset.column_names)
    return dataset


def check_json_lines(path: Path) -> None:
    """Raises ValueError naming the file and line of the first line that is not UTF-8 or not a
    JSON object (JSON Lines), or where a file holding one JSON array stops being JSON."""
    data = path.read_bytes()
    if data.lstrip().startswith(b"["):
        try:
            json.loads(data)
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {e.lineno}: not JSON ({e.msg})") from None
        return
    for line_no, raw in enumerate(data.split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{path}, line {line_no}: not UTF-8 text ({e.reason} at byte {e.start})"
            ) from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {line_no}: not a JSON object ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}, line {line_no}: a row is a JSON object, got {type(row).__name__}")
