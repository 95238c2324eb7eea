"""`kill -USR1 <pid>` makes a running app log where each of its asyncio tasks waits.

For a run that seems stuck (a step that never ends, a shutdown that does not finish): the
main thread of such a program sits in the event loop's select whatever the cause, so a thread
dump says nothing; the tasks' stacks name the call each one awaits.
"""

from __future__ import annotations

import asyncio
import io
import logging
import signal
import threading

logger = logging.getLogger(__name__)


def log_tasks_on_sigusr1() -> None:
    """From now on, SIGUSR1 logs the stack of every task of the running loop (as a warning).
    Only a loop of the main thread can take signals: elsewhere, nothing changes."""
    if threading.current_thread() is threading.main_thread():
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, log_tasks)


def log_tasks() -> None:
    text = io.StringIO()
    tasks = asyncio.all_tasks()
    for task in tasks:
        task.print_stack(file=text)
    logger.warning("%d asyncio tasks, where each waits (SIGUSR1):\n%s", len(tasks), text.getvalue())
