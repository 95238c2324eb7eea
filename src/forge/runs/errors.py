"""The errors a run stops with on purpose: each message says what happened and what to do."""


class RunStopped(RuntimeError):
    """The run cannot go on (an actor died, training diverged or starved); the app prints the
    message, names the newest checkpoint, and exits with status 1."""


class ActorFailed(RunStopped):
    """An actor that nothing replaces died or hung: what a restart from the newest checkpoint
    can heal (`forge.runs.restarts`), unlike a diverged loss or a bad input."""
