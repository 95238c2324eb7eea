"""SIGUSR1 to a program running forge's task dump logs each task's stack, naming what it awaits."""

import signal
import subprocess
import sys
import textwrap

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
