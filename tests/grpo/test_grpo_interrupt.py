"""Ctrl-C stops a GRPO run cleanly: exit code 130, every actor process gone, no hang, no
traceback, and a word on where to resume."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.slow


def test_ctrl_c_stops_the_run_and_every_actor(write_grpo_config, tmp_path):
    config = write_grpo_config()
    # SIGINT must be at its default in the child, as in a terminal (a background job of a
    # non-interactive shell would inherit it ignored), and the app leads a process group, as a
    # terminal's foreground job does.
    app = subprocess.Popen(
        # faulthandler: a SIGABRT prints every thread's stack, for a run that does not stop.
        [
            sys.executable,
            "-X",
            "faulthandler",
            "-m",
            "apps.grpo.main",
            "--config",
            str(config),
            "max_steps=100000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=os.getcwd(),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        process_group=0,
    )
    try:
        deadline = time.time() + 120
        seen = []
        for line in app.stdout:
            seen.append(line)
            if line.split("/")[0].split() == ["step", "1"]:  # the progress line of step 1
                break
            assert time.time() < deadline, "the run did not reach step 1:\n" + "".join(seen[-30:])
        else:
            raise AssertionError("the run ended before step 1:\n" + "".join(seen[-30:]))
        actors = psutil.Process(app.pid).children(recursive=True)
        assert len(actors) >= 7  # every actor, the store and the logger run in processes of their own
        os.killpg(app.pid, signal.SIGINT)  # Ctrl-C: every process of the group
        try:
            output = app.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            raise AssertionError(f"no exit within 60 s of Ctrl-C:\n{where_it_hangs(app)[-12000:]}") from None
    finally:
        app.kill()
    assert app.returncode == 130, output[-2000:]
    assert "interrupted: actors stopped\nno checkpoint yet" in output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    _, alive = psutil.wait_procs(actors, timeout=15)
    assert alive == []


def where_it_hangs(app: subprocess.Popen) -> str:
    """What the app printed, then its asyncio tasks' stacks (`forge.runs.task_dump`) and its
    threads' (faulthandler's answer to SIGABRT)."""
    app.send_signal(signal.SIGUSR1)
    time.sleep(2)
    app.send_signal(signal.SIGABRT)
    try:
        return app.communicate(timeout=15)[0]
    except subprocess.TimeoutExpired as e:  # an actor process still holds the pipe open
        return e.output.decode(errors="replace") if isinstance(e.output, bytes) else e.output or ""
