"""Actor faults as clear errors: which actor died, and how.

Without this, Monarch's default for a dead actor process is to interrupt the main thread,
which the app cannot tell from the user's Ctrl-C. `FaultWatch` takes those reports
(supervision's `on_unrecoverable`) and turns them into a `RunStopped` that a run awaits
beside its loops; `describe_actor_error` does the same for an error raised by a call.
"""

from __future__ import annotations

import asyncio
import logging
import re

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch.actor import ActorError

from forge.controller import supervision
from forge.controller.liveness import ActorHungError
from forge.runs.errors import ActorFailed, RunStopped

logger = logging.getLogger(__name__)

# Monarch's messages: "Actor call TitanTrainer_3.train_step failed." and
# "Endpoint call Generator_1.generate() failed, ...".
_CALL_RE = re.compile(r"(?:Actor|Endpoint) call (\S+?)\.(\w+)")


def _last_line(report: str) -> str:
    lines = [line.strip() for line in report.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no report"


class FaultWatch:
    """`failed` completes with a `RunStopped` when an actor that nothing replaces dies."""

    def __enter__(self) -> FaultWatch:
        self._loop = asyncio.get_running_loop()
        self.failed: asyncio.Future = self._loop.create_future()
        supervision.on_unrecoverable(self._on_failure)
        return self

    def _on_failure(self, actor: str, report: str) -> None:  # from a Monarch thread
        error = ActorFailed(f"actor {actor} died: {_last_line(report)}")
        self._loop.call_soon_threadsafe(lambda: self.failed.done() or self.failed.set_exception(error))

    def __exit__(self, *exc) -> None:
        # Not Monarch's default (interrupt the main thread): the run is over, and reports of
        # the same death often arrive while it stops its actors.
        supervision.on_unrecoverable(_log_late_failure)
        if self.failed.done():
            self.failed.exception()  # retrieved: no "never retrieved" warning


def _log_late_failure(actor: str, report: str) -> None:
    logger.warning("actor %s died after its run ended: %s", actor, _last_line(report))


def describe_actor_error(error: BaseException) -> RunStopped | None:
    """A `RunStopped` naming the actor for an error raised by an actor call, else None."""
    if isinstance(error, ActorHungError):  # it names the actor already
        return ActorFailed(str(error))
    if not isinstance(error, ActorError | SupervisionError):
        return None
    text = str(error)
    how = "died during" if isinstance(error, SupervisionError) else "raised in"
    match = _CALL_RE.search(text)
    # describe_failure adds where the actor ran when it is known (a worker host).
    actor = supervision.describe_failure(match.group(1)) if match else ""
    where = f"actor {actor} {how} {match.group(2)}()" if match else f"an actor {how} a call"
    stopped = ActorFailed if isinstance(error, SupervisionError) else RunStopped
    return stopped(f"{where}: {_last_line(text)}")


async def wait_for_loops(main: asyncio.Task, others: list[asyncio.Task]):
    """`main`'s result, once it completes. An actor fault, or an error in any of the tasks,
    stops the wait first; an actor's error is raised as a `RunStopped` naming the actor."""
    with FaultWatch() as faults:
        done, _ = await asyncio.wait([main, *others, faults.failed], return_when=asyncio.FIRST_COMPLETED)
        for task in (faults.failed, *others, main):  # a fault first: it explains the other errors
            if task in done and task.exception() is not None:
                error = task.exception()
                raise describe_actor_error(error) or error
    return main.result()
