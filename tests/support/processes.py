"""An app's processes: the live child processes a finished run left behind, the actor
processes of a running app, and an app run whose actor is killed mid-run."""

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

# This process's descendants when the running test began (`note_test_start`): helpers that live
# as long as the process (torch.compile's worker pool, multiprocessing's resource tracker) and,
# under pytest-xdist, what another module's fixtures hold. None of them is a test's leftover.
_before_test: set[int] = set()


def note_test_start() -> None:
    _before_test.clear()
    _before_test.update(c.pid for c in psutil.Process().children(recursive=True))


def children_left(timeout: float) -> list[psutil.Process]:
    """The live descendants this process made since the running test began, once none are left
    or after `timeout` seconds (actor processes take a moment to exit after their mesh is
    stopped)."""
    deadline = time.time() + timeout
    while True:
        children = [
            c
            for c in psutil.Process().children(recursive=True)
            if c.pid not in _before_test and c.status() != psutil.STATUS_ZOMBIE
        ]
        if not children or time.time() > deadline:
            return children
        time.sleep(0.2)


def actor_processes(app_pid: int, name: str) -> list[psutil.Process]:
    """The app's live actor processes of meshes launched as `name`, one per mesh, newest mesh
    last (Monarch names each process after its mesh, `<name>_<n>`, and the processes an actor
    starts inherit that name; an earlier run's may still be exiting)."""
    found = {}
    for child in psutil.Process(app_pid).children(recursive=True):
        try:
            process_name = child.environ().get("HYPERACTOR_PROCESS_NAME", "")
            if child.status() != psutil.STATUS_ZOMBIE and (
                m := re.match(rf"{name.lower()}_(\d+)-", process_name)
            ):
                found[child.pid] = (int(m.group(1)), child)
        except psutil.Error:
            continue
    actors = [(n, child) for n, child in found.values() if child.ppid() not in found]
    return [child for _, child in sorted(actors, key=lambda item: item[0])]


def run_killing_after_checkpoint(
    argv: list[str], run_dir: Path, actor: str, step: int = 2
) -> tuple[int, str]:
    """Runs the GRPO app (`argv`) in a subprocess, SIGKILLs its `actor` process once the run's
    step-`step` checkpoint is complete, and waits for the app to end: (exit code, its output)."""
    app = subprocess.Popen(
        [sys.executable, "-m", "apps.grpo.main", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 600
        while not (run_dir / "checkpoints" / f"step_{step:08d}" / "run_state.pt").exists():
            if app.poll() is not None or time.time() > deadline:
                app.kill()
                output = app.communicate()[0]
                raise AssertionError(f"the run ended before its step-{step} checkpoint:\n{output[-4000:]}")
            time.sleep(0.1)
        [process] = actor_processes(app.pid, actor)
        process.send_signal(signal.SIGKILL)
        output = app.communicate(timeout=600)[0]
    finally:
        app.kill()
    return app.returncode, output
