"""Finding a run's files (metrics, rollout records) from its output directory.

A run writes config.yaml into its output directory; the metrics and rollout paths it used
are read from there, so that `python -m forge.plot RUN_DIR` finds them wherever they went.
Paths in config.yaml may be relative to where the run was started: when such a path does
not resolve, the file of the same name inside RUN_DIR is used.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from forge.observability.jsonl import read_jsonl

DEFAULT_NAMES = {"jsonl_path": "metrics.jsonl", "rollouts_path": "rollouts.jsonl"}


def run_file(run_dir: str | Path, key: str) -> Path:
    """The path of `metrics.<key>` (``jsonl_path`` or ``rollouts_path``) of the run in `run_dir`."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a directory (expected a run's output_dir)")
    default = run_dir / DEFAULT_NAMES[key]
    config_path = run_dir / "config.yaml"
    if config_path.is_file():
        configured = ((yaml.safe_load(config_path.read_text()) or {}).get("metrics") or {}).get(key)
        if configured:
            for candidate in (Path(configured), run_dir / Path(configured).name):
                if candidate.is_file():
                    return candidate
    if default.is_file():
        return default
    raise FileNotFoundError(f"{run_dir} holds no {DEFAULT_NAMES[key]} (nor does its config.yaml name one)")


def read_metric_rows(path: str | Path) -> list[dict]:
    """The rows of a metrics JSONL file, of its latest run only: a file that several runs
    appended to restarts its step count at each run."""
    rows: list[dict] = []
    for row in read_jsonl(path):  # a cut last line is skipped with a warning
        if rows and row["step"] < rows[-1]["step"]:
            rows = []
        rows.append(row)
    return rows
