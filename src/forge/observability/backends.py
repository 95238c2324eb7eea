"""Where reduced metrics go. Each backend gets `log(step, metrics)` once per flush."""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Literal

from forge.config import ForgeConfigModel
from forge.observability.jsonl import JsonlAppender, keep_rows


class MetricBackend(ABC):
    @abstractmethod
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None:  # noqa: B027 - most backends hold nothing to release
        pass


def _format_value(v: float) -> str:
    # nan (an eval whose every row failed has no mean reward) and inf print as such.
    if math.isfinite(v) and v == int(v) and abs(v) < 1e9:
        return str(int(v))
    return f"{v:.4g}"


class ConsoleBackend(MetricBackend):
    """One compact line per step on the `forge.metrics` logger: `step 3 | a/b=1 c/d=0.5`."""

    def __init__(self, keys: list[str] | None = None):
        self.keys = keys
        # Showing these lines is this backend's whole job, so it does not depend on how the
        # process it runs in (the metric logger actor's) configured logging.
        self._logger = logging.getLogger("forge.metrics")
        self._logger.setLevel(logging.INFO)
        if not self._logger.handlers:
            self._logger.addHandler(logging.StreamHandler(sys.stdout))
            self._logger.propagate = False

    def log(self, step: int, metrics: dict[str, float]) -> None:
        shown = {k: metrics[k] for k in (self.keys or sorted(metrics)) if k in metrics}
        line = " ".join(f"{k}={_format_value(v)}" for k, v in shown.items())
        self._logger.info("step %d | %s", step, line)


class JsonlBackend(MetricBackend):
    """Appends one JSON object per step: {"step": s, "time": t, "<key>": value, ...}, where
    `time` is the wall time (seconds since the epoch) of the flush. JSON has no NaN or infinity:
    such a value is written as null, and the row counts them in `metrics/non_finite`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._file = JsonlAppender(self.path)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {k: v if math.isfinite(v) else None for k, v in metrics.items()}
        non_finite = sum(v is None for v in row.values())
        if non_finite:
            row["metrics/non_finite"] = non_finite
        self._file.write({"step": step, "time": time.time(), **row})

    def close(self) -> None:
        self._file.close()


class TensorBoardBackend(MetricBackend):
    """Scalars for TensorBoard in `log_dir`. The writer opens at the first row, with that row's
    step as `purge_step`: a resumed run's first row is the step after its checkpoint, so
    TensorBoard hides what the stopped run logged from there on, as `drop_metrics_after`
    drops those rows from the JSONL file (a run started afresh in the folder hides an earlier
    run's events from its own first step on)."""

    def __init__(self, log_dir: str | os.PathLike):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("the tensorboard backend needs `pip install forge[tensorboard]`") from e
        self._log_dir, self._summary_writer = str(log_dir), SummaryWriter
        self._writer = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._writer is None:
            self._writer = self._summary_writer(self._log_dir, purge_step=step)
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def drop_metrics_after(path: Path, step: int) -> None:
    """Remove the rows of a metrics JSONL file logged after ``step`` (a run resumed from the
    checkpoint of ``step`` logs them again). The file is replaced in one rename."""
    keep_rows(path, lambda _, row: row["step"] <= step)


class WandbConfig(ForgeConfigModel):
    project: str = "forge"
    name: str | None = None
    entity: str | None = None
    # offline: the run is written under `dir` and needs no network (`wandb sync` uploads it).
    mode: Literal["offline", "online", "disabled"] = "offline"
    dir: str | None = None


class WandbBackend(MetricBackend):
    """A Weights & Biases run that gets every row, with the app's config stored in the run."""

    def __init__(self, cfg: WandbConfig, run_config: dict | None = None):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("metrics.wandb needs `pip install forge[wandb]`") from e
        if cfg.dir is not None:
            Path(cfg.dir).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=cfg.project,
            name=cfg.name,
            entity=cfg.entity,
            mode=cfg.mode,
            dir=cfg.dir,
            config=run_config or {},
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()
