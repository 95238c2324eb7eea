"""The reward worker process (see `forge.data.reward_scoring`).

    python -m forge.data.reward_worker READ_FD WRITE_FD

It receives the reward function names, answers "ready" (or why not) once they are
imported, then for each list of calls it receives sends one outcome per call, as soon as
that call returns. It imports only the reward functions, so that a restart is cheap.
"""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection

from forge.data.rewards import get_reward_fn


class CallFailed:
    """The outcome of a call that raised: the error's text, for the log."""

    def __init__(self, message: str):
        self.message = message


class TimedOut:
    """The outcome of a call that did not return within the time limit."""


Outcome = float | CallFailed | TimedOut


def call_here(fn, prompt: str, response: str, target: str) -> Outcome:
    """One call in this process; an exception becomes a `CallFailed`."""
    try:
        return float(fn(prompt, response, target))
    except Exception as e:
        return CallFailed(f"{type(e).__name__}: {e}")


def serve(receive: Connection, send: Connection) -> None:
    try:
        functions = [get_reward_fn(name) for name in receive.recv()]
    except ValueError as e:
        send.send(CallFailed(str(e)))
        return
    send.send("ready")
    while True:
        try:
            calls = receive.recv()
        except EOFError:  # the parent closed the pipe or died
            return
        for index, prompt, response, target in calls:
            send.send(call_here(functions[index], prompt, response, target))


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
