"""What the CPU demo benches read back from a finished app run (its metrics.jsonl)."""

from __future__ import annotations

import json
from pathlib import Path


def read_rows(output_dir: Path) -> list[dict]:
    """The run's metrics rows; none when it has not run yet."""
    metrics = output_dir / "metrics.jsonl"
    if not metrics.is_file():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def curve(rows: list[dict]) -> list[tuple[int, float, float]]:
    """(step, held-out accuracy, seconds of train steps up to it) at each eval: the sum of
    `grpo/step_s`, so start-up and the warm start are not counted."""
    seconds, out = 0.0, []
    for row in rows:
        seconds += row.get("grpo/step_s", 0.0) if row["step"] else 0.0
        if "eval/accuracy" in row:
            out.append((row["step"], row["eval/accuracy"], seconds))
    return out
