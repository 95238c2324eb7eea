"""SIGUSR1 to a program running forge's task dump logs each task's stack, naming what it awaits."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

PROGRAM = textwrap.dedent(
    """
    import asyncio, logging
    from forge.runs.task_dump import log_tasks_on_sigusr1

    async def waits_for_a_reply_that_never_comes():
        await asyncio.Event().wait()

    async def main():
        log_tasks_on_sigusr1()
        task = asyncio.create_task(waits_for_a_reply_that_never_comes())
        await asyncio.sleep(0)
        print("ready", flush=True)
        await task

    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main())
    """
)


def test_sigusr1_logs_each_task_and_what_it_awaits():
    program = subprocess.Popen(
        [sys.executable, "-c", PROGRAM], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert program.stdout.readline() == "ready\n"
        program.send_signal(signal.SIGUSR1)
        logged = ""
        # A frame line of each task: `File "<string>", line N, in <function>`.
        while not all(f", in {name}\n" in logged for name in ("main", "waits_for_a_reply_that_never_comes")):
            line = program.stderr.readline()
            assert line, "the program ended or closed stderr:\n" + logged
            logged += line
        assert "WARNING:forge.runs.task_dump:2 asyncio tasks, where each waits (SIGUSR1):" in logged
        assert program.poll() is None  # and the program goes on
    finally:
        program.kill()
        program.communicate()


def test_the_restart_supervisor_passes_sigusr1_to_the_run(tmp_path):
    """With max_restarts the app's first process supervises and the run is its child: SIGUSR1
    to the process the user started reaches the run, and kills neither."""
    (tmp_path / "waiting_app.py").write_text(PROGRAM)
    supervisor = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from forge.runs.restarts import run_with_restarts; "
            "sys.exit(run_with_restarts('waiting_app', [], 0, 0.0, lambda: None))",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])},
        process_group=0,
    )
    try:
        assert supervisor.stdout.readline() == "ready\n"
        supervisor.send_signal(signal.SIGUSR1)
        # Read by a thread: if the supervisor died, its orphaned child keeps stderr open.
        logged = []

        def read_lines() -> None:
            for line in supervisor.stderr:
                logged.append(line)

        threading.Thread(target=read_lines, daemon=True).start()
        deadline = time.monotonic() + 60
        while not any("where each waits (SIGUSR1)" in line for line in logged):
            assert time.monotonic() < deadline, "no task dump within 60 s:\n" + "".join(logged)
            assert supervisor.poll() is None, f"SIGUSR1 ended the supervisor ({supervisor.returncode})"
            time.sleep(0.1)
    finally:
        os.killpg(supervisor.pid, signal.SIGKILL)  # the supervisor and the run
        supervisor.wait()
