"""ForgeActor: the base class of every forge actor, and of users' own actors.

A subclass adds `@endpoint async def ...` methods (and optionally overrides `setup`);
launching is the class's job:

    actor = await MyEnv.options(procs=1).as_actor(arg)      # one actor mesh
    svc = await MyEnv.options(num_replicas=2).as_service()  # replicas behind a router
    await MyEnv.shutdown(actor)                             # or svc
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import socket
from typing import Any

from monarch.actor import Actor, endpoint

from forge.controller import supervision
from forge.controller.liveness import Probe
from forge.controller.provisioner import get_provisioner

logger = logging.getLogger(__name__)

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

    # Monarch refuses classes that mix sync and async endpoints: keep every endpoint async.
    @endpoint
    async def setup(self) -> None:
        """Runs once after construction on every rank (load a model, connect to the store...)."""

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
    async def launch(cls, name: str, *args: Any, **kwargs: Any):
        """Spawns one actor mesh named `name` and runs its `setup`. Returns (mesh, actor)."""
        supervision.remember_name(name)
        provisioner = await get_provisioner()
        mesh = await provisioner.get_proc_mesh(name=name, **cls._placement())
        try:
            actor = mesh.spawn(name, cls._actor_class(), *args, **kwargs)
            await actor.setup.call()
            provisioner.note_processes(mesh, list((await actor.process.call()).values()))
        except BaseException:
            await provisioner.stop_proc_mesh(mesh)
            raise
        return mesh, actor

    @classmethod
    async def as_actor(cls, *args: Any, **kwargs: Any):
        """Spawns the actor on its own proc mesh, runs `setup`, returns the actor handle."""
        name = cls._unique_name()
        mesh, actor = await cls.launch(name, *args, **kwargs)
        _meshes_of_actors[id(actor)] = (actor, mesh, name)
        return actor

    @classmethod
    async def as_service(
        cls, *args: Any, routing: str = "round_robin", probe: Probe | None = None, **kwargs: Any
    ):
        """Starts `num_replicas` copies, each on its own mesh, behind one `Service` handle;
        with `probe`, idle replicas that stop answering are replaced (forge.controller.liveness)."""
        from forge.controller.service import Service

        service = Service(cls, args, kwargs, num_replicas=cls.num_replicas, routing=routing, probe=probe)
        await service.start()
        return service

    @classmethod
    async def shutdown(cls, handle) -> None:
        """Stops an actor returned by `as_actor` or a service returned by `as_service`."""
        from forge.controller.service import Service

        if isinstance(handle, Service):
            await handle.stop()
            return
        entry = _meshes_of_actors.pop(id(handle), None)
        if entry is None:
            raise ValueError("shutdown(): this handle was not created by as_actor(), or is already stopped")
        provisioner = await get_provisioner()
        await provisioner.stop_proc_mesh(entry[1])


async def kill_actor(handle) -> str:
    """Kills the processes of an actor returned by `as_actor` that hung (it is stopped with the
    others at shutdown); its death is expected, so supervision only logs it. Returns its name."""
    _, mesh, name = _meshes_of_actors[id(handle)]
    supervision.register(name, lambda report: logger.info("%s was killed after it hung", name))
    (await get_provisioner()).kill_proc_mesh(mesh)
    return name


# id(actor handle) -> (handle, mesh, name); the handle is kept so its id cannot be reused.
_meshes_of_actors: dict[int, tuple[Any, Any, str]] = {}
