"""What a finished run left behind: the live child processes of this (the test's) process."""

import time

import psutil


def children_left(timeout: float) -> list[psutil.Process]:
    """This process's live descendants, once none are left or after `timeout` seconds (actor
    processes take a moment to exit after their mesh is stopped)."""
    deadline = time.time() + timeout
    while True:
        children = [
            c for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE
        ]
        if not children or time.time() > deadline:
            return children
        time.sleep(0.2)
