"""Progress of a training run: a bar with ETA on a terminal, plain lines anywhere else.

On a terminal, tqdm draws one bar that shows the step, the ETA and the key numbers of the
last step, and messages (an eval result) are printed above it. Written to a file or a CI
log, a bar would be a mess of carriage returns, so each reported step is one plain line,
`step   12/400 | reward 0.512 | ... | eta 3m05s`, the same numbers as the bar.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class Progress:
    """Reports steps `initial + 1 .. total` of a run to `stream` (stdout by default).

    `every` thins the plain lines (the bar always moves); the last step is always reported.
    """

    def __init__(
        self,
        total: int,
        *,
        desc: str,
        initial: int = 0,
        every: int = 1,
        stream: TextIO | None = None,
    ):
        self.total, self.initial, self.every = total, initial, every
        self.stream = stream if stream is not None else sys.stdout
        self._started = time.perf_counter()
        self._bar = None
        if self.stream.isatty():
            self._bar = tqdm(
                total=total, initial=initial, desc=desc, file=self.stream, dynamic_ncols=True, unit="step"
            )

    @property
    def is_bar(self) -> bool:
        return self._bar is not None

    def update(self, step: int, fields: dict[str, str], *, persist: bool = False) -> None:
        """Step `step` is done; `fields` are its key numbers, already formatted, in display order.

        `persist` also leaves the step's line above the bar (a step with an eval result) and
        prints it whatever `every` says.
        """
        done = step - self.initial
        eta = (time.perf_counter() - self._started) / done * (self.total - step) if done > 0 else 0.0
        width = len(str(self.total))
        shown = " | ".join(f"{name} {value}" for name, value in fields.items())
        line = f"step {step:{width}d}/{self.total} | {shown} | eta {format_duration(eta)}"
        if self._bar is not None:
            if persist:
                self._bar.write(line, file=self.stream)
            self._bar.set_postfix_str(shown, refresh=False)
            self._bar.update(step - self._bar.n)
        elif persist or step % self.every == 0 or step == self.total:
            self.message(line)

    def message(self, line: str) -> None:
        """A line of its own (an eval result, a note), above the bar on a terminal."""
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
