"""One replica of a service: an actor mesh on a proc mesh of its own, launched and called.

The one place that calls a ForgeActor's Monarch endpoints (`call_one`, `call`); everything
else calls through a `Service` (forge.controller.service).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import forge.controller.supervision as supervision
from forge.controller.provisioner import get_provisioner

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Replica:
    index: int
    name: str
    mesh: Any
    actor: Any
    # Processes of the mesh (procs x hosts), each running the actor; an endpoint runs on all.
    ranks: int = 1
    healthy: bool = True
    inflight: int = 0
    last_chosen: int = -1  # the service's count of calls routed when it last took one
    served: int = 0
    failures: int = 0
    probing: bool = False
    failed: asyncio.Event = field(default_factory=asyncio.Event)

    def mark_failed(self, reason: str) -> None:
        # Both supervision and the failed call report the same death: count it once.
        if not self.healthy:
            return
        logger.warning("replica %s failed: %s", self.name, reason.splitlines()[0] if reason else "")
        self.healthy = False
        self.failures += 1
        self.failed.set()

    async def answers(self, endpoint_name: str, args: tuple, kwargs: dict) -> list[Any]:
        """`endpoint_name(*args, **kwargs)` run on every rank: their answers, in rank order."""
        endpoint = getattr(self.actor, endpoint_name)
        if self.ranks == 1:
            return [await endpoint.call_one(*args, **kwargs)]
        ranked = (await endpoint.call(*args, **kwargs)).items()
        return [value for _, value in sorted(ranked, key=lambda item: item[0].rank)]


async def launch(actor_cls, index: int, name: str, args: tuple, kwargs: dict) -> Replica:
    """Spawns `actor_cls` (a `ForgeActor.options()` class) on a new proc mesh named `name` and
    runs its `setup` on every rank; stops the mesh again if that fails."""
    supervision.remember_name(name)
    provisioner = await get_provisioner()
    mesh = await provisioner.get_proc_mesh(name=name, for_forge_actor=True, **actor_cls._placement())
    try:
        actor = mesh.spawn(name, actor_cls._actor_class(), *args, **kwargs)
        await actor.assign_replica.call(index)
        await actor.setup.call()
        processes = list((await actor.process.call()).values())
        provisioner.note_processes(mesh, processes)
    except BaseException:
        await provisioner.stop_proc_mesh(mesh)
        raise
    return Replica(index, name, mesh, actor, ranks=len(processes))
