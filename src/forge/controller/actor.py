"""ForgeActor: the base class of every forge actor, and of users' own actors.

A subclass adds `@endpoint async def ...` methods (and optionally overrides `setup`);
launching is the class's job, and both ways give a `Service` handle (forge.controller.service):

    actor = await MyEnv.options(procs=1).as_actor(arg)      # one replica, never replaced
    svc = await MyEnv.options(num_replicas=2).as_service()  # replicas behind a router
    obs = await actor.reset.route()                         # or svc.reset.route(), .fanout()
    await MyEnv.shutdown(actor)                             # or svc
"""

from __future__ import annotations

import itertools
import os
import random
import socket
from typing import Any

from monarch.actor import Actor, endpoint

from forge import mesh_process
from forge.controller.liveness import Probe
from forge.controller.service import Service

_OPTION_NAMES = ("procs", "hosts", "with_gpus", "gpu_group", "num_replicas", "mesh_name")
_spawn_counter = itertools.count()


class ForgeActor(Actor):
    # Placement defaults; `options()` overrides them on a subclass.
    procs: int = 1
    hosts: int | None = None
    with_gpus: bool = False
    # Meshes of one GPU group share GPUs (see forge.controller.provisioner).
    gpu_group: str | None = None
    num_replicas: int = 1
    mesh_name: str | None = None
    # Which replica of its service this actor is (a replacement keeps the index; a lone actor
    # is replica 0): set before `setup`, for what an actor reports per replica.
    replica_index: int = 0

    # Monarch refuses classes that mix sync and async endpoints: keep every endpoint async.
    @endpoint
    async def setup(self) -> None:
        """Runs once after construction on every rank (load a model, connect to the store...)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> ForgeActor:
        mesh_process.actor_made()
        return super().__new__(cls)

    async def __cleanup__(self, exc: Exception | None) -> None:
        """When the actor stops (its process exits next): a subclass that overrides this calls
        it last."""
        mesh_process.prepare_exit()

    @endpoint
    async def assign_replica(self, index: int) -> None:
        self.replica_index = index

    @endpoint
    async def process(self) -> tuple[str, int]:
        """(host name, pid) of this process: how a hung actor is killed, and a health probe."""
        return socket.gethostname(), os.getpid()

    @endpoint
    async def rng_state(self) -> dict[str, Any]:
        """This process's random generators (torch CPU and CUDA, Python's), for run checkpoints."""
        import torch

        state = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    @endpoint
    async def load_rng_state(self, state: dict[str, Any]) -> None:
        import torch

        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])

    @classmethod
    def options(cls, **options: Any) -> type[ForgeActor]:
        """A subclass of `cls` with the given placement options (procs, hosts, with_gpus, ...)."""
        unknown = sorted(set(options) - set(_OPTION_NAMES))
        if unknown:
            raise TypeError(
                f"{cls.__name__}.options(): unknown option(s) {unknown}; allowed: {list(_OPTION_NAMES)}"
            )
        # The subclass lives only on the client side; the mesh spawns `_actor_class()`.
        return type(cls.__name__, (cls,), {**options, "_configured_from": cls._actor_class()})

    @classmethod
    def _actor_class(cls) -> type[ForgeActor]:
        return cls.__dict__.get("_configured_from", cls)

    @classmethod
    def _placement(cls) -> dict[str, Any]:
        return {
            "procs": cls.procs,
            "hosts": cls.hosts,
            "with_gpus": cls.with_gpus,
            "gpu_group": cls.gpu_group,
        }

    @classmethod
    def _unique_name(cls) -> str:
        # Mesh names must be unique: supervision failures are routed by them.
        base = cls.mesh_name or cls._actor_class().__name__
        return f"{base}_{next(_spawn_counter)}"

    @classmethod
    async def as_actor(cls, *args: Any, **kwargs: Any) -> Service:
        """Starts a lone actor: one replica on its own proc mesh, which nothing replaces (its
        death stops the program, see forge.controller.supervision). `setup` has run."""
        service = Service(cls, args, kwargs, num_replicas=1, replace_failed=False)
        await service.start()
        return service

    @classmethod
    async def as_service(cls, *args: Any, probe: Probe | None = None, **kwargs: Any) -> Service:
        """Starts `num_replicas` copies, each on its own mesh, behind one `Service` handle;
        a copy that dies is replaced. With `probe`, idle replicas that stop answering are
        replaced too (forge.controller.liveness)."""
        service = Service(cls, args, kwargs, num_replicas=cls.num_replicas, probe=probe)
        await service.start()
        return service

    @classmethod
    async def shutdown(cls, handle: Service) -> None:
        """Stops a handle returned by `as_actor` or `as_service`."""
        await handle.stop()
