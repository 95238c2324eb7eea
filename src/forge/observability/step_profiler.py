"""The PyTorch profiler over one train step of a process and what that process does until the
next step begins (the weight publish, the next batch's arrival), written as a table and a trace.

The window opens when step `step` starts and closes when step `step + 1` starts, so the time
the app adds around the engine's own step is inside it. The profiler records CPU operators on
the thread that started it only (GPU kernels it records from every thread): the caller runs
the profiled step on that thread.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

logger = logging.getLogger(__name__)

TOP_OPERATORS = 25


class StepProfiler:
    def __init__(self, step: int | None, out_dir: str | None, name: str) -> None:
        if step is not None and out_dir is None:
            raise ValueError("a profiled step needs a directory for the profile")
        self.step = step
        self.out_dir = Path(out_dir) if out_dir else None
        self.name = name
        self._profile: profile | None = None
        self._opened = 0.0

    @property
    def active(self) -> bool:
        return self._profile is not None

    def step_starts(self, step: int) -> None:
        """Called as train step `step` (counted from 1) begins."""
        if self._profile is not None and step == self.step + 1:
            self._close()
        if step == self.step:
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self._profile = profile(activities=activities)
            self._profile.start()
            self._opened = time.perf_counter()

    def _close(self) -> None:
        self._profile.stop()
        seconds = time.perf_counter() - self._opened
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = self.out_dir / f"{self.name}_step{self.step}"
        stem.with_suffix(".txt").write_text(summary(self._profile, seconds))
        self._profile.export_chrome_trace(f"{stem}.json.gz")  # torch compresses a .gz path
        self._profile = None
        logger.info("profile of step %d written to %s.txt and %s.json.gz", self.step, stem, stem)


def summary(result: profile, seconds: float) -> str:
    """The window's length, the time in the labelled ranges (`forge.*`), and the operators that
    took the most GPU and CPU time."""
    events = result.key_averages()
    # Kernels only: an operator's or a labelled range's device time is that of its kernels.
    on_device = sum(e.self_device_time_total for e in events if _is_kernel(e)) / 1e6
    lines = [
        f"window {seconds:.3f} s; GPU kernel time {on_device:.3f} s ({on_device / seconds:.0%} of the window)",
        "",
        "labelled ranges (CPU wall s, calls):",
    ]
    for event in sorted(events, key=lambda e: -e.cpu_time_total):
        if event.key.startswith("forge.") and event.device_type == DeviceType.CPU:
            lines.append(f"  {event.key:<40} {event.cpu_time_total / 1e6:8.3f} {event.count:6d}")
    for column in ("self_device_time_total", "self_cpu_time_total"):
        lines += ["", f"top operators by {column}:"]
        lines.append(events.table(sort_by=column, row_limit=TOP_OPERATORS, max_name_column_width=60))
    return "\n".join(lines) + "\n"


def _is_kernel(event) -> bool:
    return event.device_type != DeviceType.CPU and not event.is_user_annotation
