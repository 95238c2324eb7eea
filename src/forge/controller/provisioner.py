"""Creates and stops proc meshes: GPUs per mesh, torch.distributed environment, shutdown order.

One provisioner per program (`init_provisioner`). Every mesh it creates gets, in each of
its processes, MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK/LOCAL_RANK (so an engine inside can
`init_process_group` without knowing about Monarch) and, when GPUs were asked for,
CUDA_VISIBLE_DEVICES listing the mesh's own GPUs first (so `cuda:LOCAL_RANK` is its own) and then
the program's other GPUs: a generator can then map the trainer's GPU memory by CUDA IPC
(`forge.store.cuda_ipc`), which fails when that GPU is hidden from it. With a `seed`, each
process also seeds Python's and torch's global RNGs with (seed, its mesh's name, its rank)
before any actor starts, so that what an actor draws from them repeats from run to run.

GPUs are handed out per mesh, or per GPU group: meshes launched with the same `gpu_group`
share the GPUs of the group's first mesh (the reference model on the trainer's GPU; or, with
`colocate`, every model actor on one GPU).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import socket
from dataclasses import dataclass, field

from monarch.actor import ProcMesh, current_rank, this_host

from forge.config import ForgeConfigModel
from forge.controller import supervision
from forge.observability.logger import FETCHER_MESH_NAME, register_mesh, unregister_mesh

logger = logging.getLogger(__name__)


class ProvisionerConfig(ForgeConfigModel):
    """How meshes are placed (on this host; see `get_proc_mesh` for multi-host)."""

    # Seconds to wait for a mesh to stop before giving up on it at shutdown.
    stop_timeout_s: float = 30.0
    # Every model actor (trainer, generator, reference) on the same GPU(s): one-GPU runs. The
    # generator's KV cache and the trainer then split the GPU's memory (see generator config).
    colocate: bool = False


@dataclass
class _MeshRecord:
    mesh: ProcMesh
    name: str
    gpus: list[str] = field(default_factory=list)
    gpu_group: str | None = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _visible_gpus() -> list[str]:
    """The GPUs this program may use: the user's CUDA_VISIBLE_DEVICES if set, else all."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g for g in env.split(",") if g.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # a torch without CUDA support
        return []


def _set_process_env(world_size: int, master_port: int, gpus: list[str], seed: int | None) -> None:
    """Runs first in every process of a new mesh (Monarch's bootstrap hook)."""
    rank = current_rank().rank
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    # Set before anything touches CUDA: the mesh's own GPUs first, then the others.
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    if seed is not None:
        import torch

        random.seed(seed + rank)
        torch.manual_seed(seed + rank)


def _mesh_seed(seed: int, mesh_name: str) -> int:
    """Mesh names end in a spawn counter (`Generator_3`); the seed must not depend on it, so
    that a run seeds an actor the same however many meshes were started before it."""
    from forge.engines.generation import sample_seed

    base = mesh_name.rstrip("0123456789").rstrip("_")
    return sample_seed(seed, int.from_bytes(base.encode()[:8], "little")) % 2**32


class Provisioner:
    def __init__(self, cfg: ProvisionerConfig | None = None, seed: int | None = None):
        self.cfg = cfg or ProvisionerConfig()
        self.seed = seed
        self._all_gpus = _visible_gpus()
        self._free_gpus = list(self._all_gpus)
        self._meshes: list[_MeshRecord] = []
        self._lock = asyncio.Lock()
        supervision.add_companion_mesh(FETCHER_MESH_NAME)

    async def get_proc_mesh(
        self,
        procs: int = 1,
        hosts: int | None = None,
        with_gpus: bool = False,
        name: str = "mesh",
        gpu_group: str | None = None,
    ) -> ProcMesh:
        """A new mesh of `procs` processes; with `with_gpus`, one GPU each, its own or its group's."""
        if hosts not in (None, 1):
            # The seam for multi-host: a host mesh from monarch's `attach_to_workers` (hosts
            # running `run_worker_loop_forever`) would replace `this_host()` below.
            raise NotImplementedError(
                f"mesh '{name}' asks for hosts={hosts}: this provisioner places meshes on this "
                "host only; use hosts=1"
            )
        async with self._lock:
            gpus = self._gpus_for(procs, name, gpu_group) if with_gpus else []
            visible = gpus + [g for g in self._all_gpus if g not in gpus] if gpus else []
            seed = None if self.seed is None else _mesh_seed(self.seed, name)
            bootstrap = functools.partial(_set_process_env, procs, _free_port(), visible, seed)
            mesh = this_host().spawn_procs(per_host={"procs": procs}, bootstrap=bootstrap, name=name)
            self._meshes.append(_MeshRecord(mesh, name, gpus, gpu_group))
        await mesh.initialized
        await register_mesh(name, mesh)
        logger.info("started mesh %s: %d procs, gpus=%s", name, procs, gpus or "none")
        return mesh

    def _gpus_for(self, procs: int, name: str, gpu_group: str | None) -> list[str]:
        """With `colocate`, the program's first GPUs; else the group's GPUs when another mesh of
        `gpu_group` holds some; else newly taken ones."""
        if self.cfg.colocate:
            if procs > len(self._all_gpus):
                raise RuntimeError(
                    f"mesh '{name}' needs {procs} GPU(s); this program sees {len(self._all_gpus)}"
                )
            return self._all_gpus[:procs]
        holder = next((r for r in self._meshes if gpu_group and r.gpu_group == gpu_group and r.gpus), None)
        if holder is None:
            return self._take_gpus(procs, name)
        if procs > len(holder.gpus):
            raise RuntimeError(
                f"mesh '{name}' needs {procs} GPU(s) but its GPU group '{gpu_group}' has "
                f"{len(holder.gpus)} ({','.join(holder.gpus)}): lower its procs or leave the group"
            )
        return holder.gpus[:procs]

    def _take_gpus(self, procs: int, name: str) -> list[str]:
        if not self._free_gpus:
            if not _visible_gpus():
                logger.warning("mesh %s asked for GPUs but this machine has none: running on CPU", name)
                return []
            raise RuntimeError(f"mesh '{name}' needs {procs} GPU(s) but all GPUs are taken")
        if len(self._free_gpus) < procs:
            raise RuntimeError(
                f"mesh '{name}' needs {procs} GPU(s) but only {len(self._free_gpus)} are free "
                f"({','.join(self._free_gpus)}): lower its procs or free GPUs"
            )
        gpus, self._free_gpus = self._free_gpus[:procs], self._free_gpus[procs:]
        return gpus

    async def stop_proc_mesh(self, mesh: ProcMesh) -> None:
        record = next((r for r in self._meshes if r.mesh is mesh), None)
        if record is None:
            return
        self._meshes.remove(record)
        still_used = {g for r in self._meshes for g in r.gpus}
        self._free_gpus.extend(g for g in record.gpus if g not in still_used and g not in self._free_gpus)
        await unregister_mesh(record.name)
        try:
            await asyncio.wait_for(mesh.stop(), self.cfg.stop_timeout_s)
        except Exception as e:  # a mesh whose process already died cannot stop cleanly
            logger.warning("mesh %s did not stop cleanly: %s", record.name, e)

    async def shutdown(self) -> None:
        """Stops every mesh, newest first (later meshes may depend on earlier ones)."""
        for record in reversed(list(self._meshes)):
            await self.stop_proc_mesh(record.mesh)


_provisioner: Provisioner | None = None


async def init_provisioner(cfg: ProvisionerConfig | None = None, seed: int | None = None) -> Provisioner:
    """The program's provisioner; `seed` seeds the global RNGs of every process it starts."""
    global _provisioner
    if _provisioner is None:
        _provisioner = Provisioner(cfg, seed)
    return _provisioner


async def get_provisioner() -> Provisioner:
    return await init_provisioner()


async def shutdown() -> None:
    global _provisioner
    if _provisioner is not None:
        await _provisioner.shutdown()
        _provisioner = None
