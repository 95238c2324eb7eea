"""A run that heals itself: `max_restarts` restarts of the whole pipeline from the newest
checkpoint when an actor that nothing replaces dies or hangs, in the same invocation.

The app becomes a supervisor that runs the pipeline in a child process (`python -m <app>` with
the user's arguments) and starts a new child after each such failure, with `resume=auto`. A
child, not a second pipeline in this process: Monarch's and TorchStore's process-wide state
does not survive a dead peer mid-call, and a fresh process starts clean. A child says an actor
failed by its exit status (ACTOR_FAILED_EXIT); any other stop (bad input, a diverged loss,
Ctrl-C) ends the invocation with the child's status. Back-off: `restart_backoff_s`, doubled at
each restart. Each child learns how many restarts came before it from RESTARTS_ENV and logs it
as `run/restarts`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

RESTARTS_ENV = "FORGE_RUN_RESTARTS"
ACTOR_FAILED_EXIT = 3


def restarts_so_far() -> int:
    """How many restarts came before this process's run (0 in a run nothing restarted)."""
    return int(os.environ.get(RESTARTS_ENV, "0"))


def starts_afresh(resume: bool | str, has_checkpoint: bool) -> bool:
    """Whether a run starts at step 0 with no earlier attempt's files to replace: not a
    resume, nor an `auto` one that finds no checkpoint after a restart."""
    if resume == "auto":
        return not has_checkpoint and not restarts_so_far()
    return not resume


def run_with_restarts(
    app: str,
    argv: list[str],
    max_restarts: int,
    backoff_s: float,
    newest_checkpoint: Callable[[], Path | None],
) -> int:
    """Runs `python -m app argv` until it ends other than by an actor failure, or has failed
    `max_restarts` + 1 times; returns the last child's exit status."""
    restarts = 0
    while True:
        resume = ["resume=auto"] if restarts else []
        code = _run_child([sys.executable, "-m", app, *argv, "max_restarts=0", *resume], restarts)
        if code != ACTOR_FAILED_EXIT:
            return code
        if restarts == max_restarts:
            print(f"gave up after {max_restarts} restart(s) (max_restarts)", file=sys.stderr)
            return code
        restarts += 1
        wait = backoff_s * 2 ** (restarts - 1)
        start = newest_checkpoint() or "the beginning (no checkpoint yet)"
        print(
            f"restart {restarts} of {max_restarts} in {wait:g} s, from {start}", file=sys.stderr, flush=True
        )
        try:
            time.sleep(wait)
        except KeyboardInterrupt:  # Ctrl-C between two children: nothing runs to stop
            print("interrupted before the restart", file=sys.stderr)
            return 130


def _run_child(command: list[str], restarts: int) -> int:
    """The child's exit status. Ctrl-C reaches the child too (one process group) and the child
    stops its actors: this process only waits for it meanwhile. (A handler, not SIG_IGN, which
    the child would inherit.) SIGUSR1, which asks a run where it waits (`forge.runs.task_dump`),
    is passed on to the child: the run is there."""
    child = subprocess.Popen(command, env={**os.environ, RESTARTS_ENV: str(restarts)})
    previous_int = signal.signal(signal.SIGINT, lambda *_: None)
    previous_usr1 = signal.signal(signal.SIGUSR1, lambda *_: child.send_signal(signal.SIGUSR1))
    try:
        return child.wait()
    finally:
        signal.signal(signal.SIGINT, previous_int)
        signal.signal(signal.SIGUSR1, previous_usr1)
