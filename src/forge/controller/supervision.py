"""Routes Monarch supervision failures to whoever can handle them.

When a process of a child mesh dies, Monarch reports a `MeshFailure` for each actor
mesh on it to the root client, whose default reaction is to exit the whole program.
That is right for a lone actor (the app cannot go on without its trainer), but a service
replica can be replaced, so services that replace their replicas register the names of their
replicas' actor meshes here and get told instead. An app that wants to stop on its own terms (naming the actor,
saying where to resume from) sets `on_unrecoverable`.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from collections.abc import Callable

import monarch.actor
from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

from forge.controller.hosts import HostUnreachableError

logger = logging.getLogger(__name__)

# Helper meshes that live on every proc beside the user's actor (Monarch's own "logger" and
# "setup", the latter running the provisioner's bootstrap; forge's metric fetcher). Their failure always comes together with the failure of the
# user actor on the same proc, which is the one that gets handled.
_companion_meshes = {"logger", "setup"}

_handlers: dict[str, Callable[[str], None]] = {}
# Meshes stopped on purpose: a failure reported for one later (its processes ending, often
# after the program moved on) is expected and only logged.
_stopped: set[str] = set()
# Where a mesh runs, for failure messages (set for meshes on worker hosts).
_descriptions: dict[str, str] = {}
# Called instead of exiting when a mesh nothing can replace fails (see `on_unrecoverable`).
_unrecoverable: Callable[[str, str], None] | None = None
# Lower-cased mesh name -> the name it was launched with, for messages.
_launched_names: dict[str, str] = {}
_lock = threading.Lock()
_installed = False


def _base_name(mesh_name: str) -> str:
    # Monarch reports an actor mesh as "<name, lower-cased>-<random suffix>".
    return mesh_name.rsplit("-", 1)[0].lower()


def register(actor_name: str, on_failure: Callable[[str], None]) -> None:
    """Calls `on_failure(report)` (from a Monarch thread) when the mesh `actor_name` fails."""
    install_fault_hook()
    with _lock:
        _handlers[actor_name.lower()] = on_failure


def add_companion_mesh(actor_name: str) -> None:
    """Declares `actor_name` a helper mesh spawned beside every actor (see above)."""
    _companion_meshes.add(actor_name.lower())


def describe(actor_name: str, where: str) -> None:
    """Records where the mesh `actor_name` runs, to name it in failures. Kept after the mesh
    stops: a failure is often reported after shutdown stopped everything (names are unique)."""
    with _lock:
        _descriptions[actor_name.lower()] = where


def describe_failure(mesh_name: str) -> str:
    """`mesh_name` and, when known, where it ran (e.g. "generator_1 (on host 1 (tls://...))")."""
    with _lock:
        where = _descriptions.get(_base_name(mesh_name))
    return f"{mesh_name} ({where})" if where else mesh_name


# What a program can report with `explain` and stop on: a call on an actor whose process (or
# host) died, or a host that could not be reached at start-up.
FAILURES = (SupervisionError, HostUnreachableError)
_FAILED_CALL = re.compile(r"Endpoint call (\w+)\.\w+\(\) failed")


def explain(error: BaseException) -> str:
    """One line for a failed call on an actor that died: which actor, where it ran, why."""
    text = str(error)
    match = _FAILED_CALL.search(text)
    if match is None:
        return text.splitlines()[0] if text else type(error).__name__
    reason = text.rsplit("has status:", 1)[-1].strip().splitlines()[0]
    return f"actor {describe_failure(match.group(1))} failed: {reason}"


def remember_name(actor_name: str) -> None:
    """Records the spelling of a mesh name, which Monarch's reports lower-case."""
    with _lock:
        _launched_names[actor_name.lower()] = actor_name


def launched_name(mesh_name: str) -> str:
    """The name a mesh was launched with (e.g. ``TitanTrainer_3``), from Monarch's report name."""
    base = _base_name(mesh_name)
    return _launched_names.get(base, base)


def on_unrecoverable(handler: Callable[[str, str], None] | None) -> None:
    """Calls `handler(actor name, report)` (from a Monarch thread) when a mesh that no service
    can replace fails, instead of stopping the program; None restores the default."""
    global _unrecoverable
    install_fault_hook()
    with _lock:
        _unrecoverable = handler


def stopped_on_purpose(actor_name: str) -> None:
    """Declares the mesh `actor_name` stopped (or replaced) on purpose: from now on its failure
    reports are logged, never handled as a failure of something still in use."""
    with _lock:
        _handlers.pop(actor_name.lower(), None)
        _stopped.add(actor_name.lower())


def _fault_hook(failure) -> None:
    name = _base_name(failure.mesh_name)
    with _lock:
        handler = _handlers.get(name)
        stopped = name in _stopped
    if stopped:
        logger.info(
            "mesh %s, stopped on purpose, ended: %s", failure.mesh_name, _first_line(failure.report())
        )
        return
    if handler is not None:
        logger.warning("replica mesh %s failed; its service will replace it", name)
        handler(failure.report())
        return
    if name in _companion_meshes:
        logger.debug("ignoring failure of companion mesh %s", failure.mesh_name)
        return
    with _lock:
        unrecoverable = _unrecoverable
    if unrecoverable is not None:
        unrecoverable(launched_name(failure.mesh_name), failure.report())
        return
    # An actor nobody can replace: keep Monarch's default, which stops the program.
    logger.error(
        "actor mesh %s failed and nothing can replace it: stopping", describe_failure(failure.mesh_name)
    )
    sys.exit(1)


def _first_line(report: str) -> str:
    return report.splitlines()[0] if report else ""


def install_fault_hook() -> None:
    global _installed
    if not _installed:
        monarch.actor.unhandled_fault_hook = _fault_hook
        _installed = True
