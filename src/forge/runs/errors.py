"""The error a run stops with on purpose: its message says what happened and what to do."""


class RunStopped(RuntimeError):
    """The run cannot go on (an actor died, training diverged or starved); the app prints the
    message, names the newest checkpoint, and exits with status 1."""
