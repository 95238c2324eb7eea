"""Creates and stops proc meshes: GPUs per mesh, torch.distributed environment, shutdown order.

One provisioner per program (`init_provisioner`). Every mesh it creates gets, in each of
its processes, MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK/LOCAL_RANK (so an engine inside can
`init_process_group` without knowing about Monarch) and, when GPUs were asked for,
CUDA_VISIBLE_DEVICES listing the mesh's own GPUs first (so `cuda:LOCAL_RANK` is its own) and then
the program's other GPUs: a generator can then map the trainer's GPU memory by CUDA IPC
(`forge.store.cuda_ipc`), which fails when that GPU is hidden from it. With a `seed`, each
process also seeds its global RNGs first (`forge.controller.seeding`); what runs in those
processes themselves is `forge.mesh_process`.

GPUs are handed out by one allocator per host (`forge.controller.gpu_pool`), with the same
rules on this host and on workers: the run's placement plan's slots (`forge.controller.gpu_plan`,
this host), `colocate` (this host), the GPUs of a sharing group's first mesh (the reference
model on the trainer's), else free ones.

Meshes run on this host, or, with `provisioner.hosts`, on the hosts of those workers
(`python -m forge.worker`; see `forge.controller.hosts`); there a sharing group shares GPUs
between meshes that span the same hosts.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from monarch.actor import ProcMesh, enable_transport, this_host
from monarch.config import configure
from pydantic import Field, model_validator

import forge.controller.supervision as supervision
from forge import mesh_process, monarch_env
from forge.config import ForgeConfigModel
from forge.controller.gpu_plan import GpuPlan
from forge.controller.gpu_pool import GpuPool
from forge.controller.hosts import HOST_AGENT_NAME, STORE_MESH_NAME, AttachedHosts, parse_worker_address
from forge.controller.liveness import kill_processes
from forge.controller.seeding import mesh_seed
from forge.observability.logger import FETCHER_MESH_NAME, register_mesh, unregister_mesh

logger = logging.getLogger(__name__)


class ProvisionerConfig(ForgeConfigModel):
    """How meshes are placed: on this host, or on the hosts of `hosts`."""

    # Seconds to wait for a mesh to stop before killing its processes (those on this host).
    stop_timeout_s: float = 30.0
    # Every model actor (trainer, generator, reference) on the same GPU(s): one-GPU runs. The
    # generator's KV cache and the trainer then split the GPU's memory (see generator config).
    colocate: bool = False
    # Addresses printed by `python -m forge.worker` on each host (tls://HOST:PORT or
    # tcp://HOST:PORT). Empty: every mesh runs on this host.
    hosts: list[str] = []
    # Host indices (into `hosts`) per actor name: the class name (TitanTrainer, Generator, ...)
    # or "torchstore" for the weight store's volume. Unlisted actors run on host 0; the
    # store's volume runs on the trainer's first host and the reference model on the trainer's
    # hosts (it has the trainer's processes and parallelism) unless listed.
    placement: dict[str, list[int]] = {}
    # How workers reach this controller: its host name or IP (None: Monarch uses this
    # machine's host name, which must then resolve to an address the workers can reach).
    controller_host: str | None = None
    # TLS files (PEM) of this controller, for tls:// workers; None: Monarch's variables
    # HYPERACTOR_TLS_CA/CERT/KEY.
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    attach_timeout_s: float = Field(60.0, gt=0, description="seconds to reach every worker at start-up")
    # A host that answers nothing for this long has its actors declared failed.
    host_timeout_s: float = Field(30.0, gt=0)

    @model_validator(mode="after")
    def _check_hosts(self) -> ProvisionerConfig:
        schemes = {parse_worker_address(a)[0] for a in self.hosts}
        if len(schemes) > 1:
            raise ValueError(f"provisioner.hosts mixes tls:// and tcp:// workers: {self.hosts}")
        for actor, indices in self.placement.items():
            bad = [i for i in indices if not 0 <= i < max(len(self.hosts), 1)]
            if not indices or bad:
                raise ValueError(
                    f"provisioner.placement.{actor}: {indices} must list host indices in "
                    f"0..{len(self.hosts) - 1} (provisioner.hosts has {len(self.hosts)} entries)"
                )
        tls = [self.tls_ca, self.tls_cert, self.tls_key]
        if any(tls) and not all(tls):
            raise ValueError("provisioner.tls_ca, tls_cert and tls_key go together: set all three")
        return self

    @property
    def tls(self) -> bool:
        return bool(self.hosts) and parse_worker_address(self.hosts[0])[0] == "tls"

    def placement_for(self, actor: str) -> list[int]:
        """The hosts listed for `actor`, or its default (see `placement`)."""
        if actor in self.placement:
            return self.placement[actor]
        if actor == STORE_MESH_NAME:
            return self.placement.get("TitanTrainer", [0])[:1]
        if actor in ("ReferenceModel", "Critic"):
            return self.placement.get("TitanTrainer", [0])
        return [0]


@dataclass
class _MeshRecord:
    mesh: ProcMesh
    name: str
    gpus: list[str] = field(default_factory=list)
    gpu_group: str | None = None
    # On workers: the host indices, the GPUs taken on each, and where each process runs.
    hosts: list[int] = field(default_factory=list)
    host_gpus: list[list[str]] = field(default_factory=list)
    where: list[dict] = field(default_factory=list)
    metrics: bool = True
    # (host name, pid) of each process, once its actor answered (`note_processes`).
    processes: list[tuple[str, int]] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def visible_gpus() -> list[str]:
    """The GPUs this program may use: the user's CUDA_VISIBLE_DEVICES if set, else all."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g for g in env.split(",") if g.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # a torch without CUDA support
        return []


class Provisioner:
    def __init__(
        self, cfg: ProvisionerConfig | None = None, seed: int | None = None, plan: GpuPlan | None = None
    ):
        self.cfg = cfg or ProvisionerConfig()
        self.seed = seed
        self._all_gpus = visible_gpus()
        self._pool = GpuPool(self._all_gpus, plan, self.cfg.colocate)
        self._meshes: list[_MeshRecord] = []
        # Stopped before any mesh: what would otherwise react to its meshes stopping (a
        # service's health loop would start replacements for replicas that shutdown stops).
        self._supervisors: list[Callable[[], Awaitable[None]]] = []
        self._lock = asyncio.Lock()
        self._hosts = AttachedHosts(self.cfg.hosts, self.cfg.placement_for) if self.cfg.hosts else None
        supervision.add_companion_mesh(FETCHER_MESH_NAME)
        supervision.add_companion_mesh(HOST_AGENT_NAME)
        if self._hosts is not None:
            self._use_network_transport()

    def _use_network_transport(self) -> None:
        """Monarch's default transport (Unix sockets) cannot leave this host: switch to the
        workers' one. Must come before anything else starts Monarch in this process."""
        if self.cfg.tls:
            files = (self.cfg.tls_ca, self.cfg.tls_cert, self.cfg.tls_key)
            if all(files):
                monarch_env.set_tls_files(*files)
            elif monarch_env.tls_files_from_env() is None:
                raise ValueError(
                    f"provisioner.hosts are TLS workers ({self.cfg.hosts[0]}) but this controller has no "
                    "certificate: set provisioner.tls_ca/tls_cert/tls_key or "
                    f"{', '.join(monarch_env.TLS_ENV.values())}"
                )
        scheme = "tls" if self.cfg.tls else "tcp"
        host = self.cfg.controller_host
        try:
            enable_transport(f"{scheme}://{host}:0" if host else scheme)
        except RuntimeError as e:
            raise RuntimeError(
                f"provisioner.hosts needs Monarch's {scheme} transport, but Monarch already started "
                "in this process: call init_provisioner() before anything else uses Monarch"
            ) from e
        timeout = f"{self.cfg.host_timeout_s:g}s"
        configure(get_proc_state_max_idle=timeout, get_actor_state_max_idle=timeout)

    async def attach_hosts(self) -> None:
        if self._hosts is not None and self._hosts.mesh is None:
            await self._hosts.attach(self.cfg.attach_timeout_s)

    async def get_proc_mesh(
        self,
        procs: int = 1,
        hosts: int | None = None,
        with_gpus: bool = False,
        name: str = "mesh",
        gpu_group: str | None = None,
        collect_metrics: bool = True,
        for_forge_actor: bool = False,
    ) -> ProcMesh:
        """A new mesh of `procs` processes on each of `hosts` hosts (default 1); with `with_gpus`,
        one GPU each, its own or its group's. On this host, or, with workers attached, on the
        hosts `provisioner.placement` gives the mesh's name. `for_forge_actor`: a ForgeActor is
        made there next, and its processes collect no garbage until then (`forge.mesh_process`)."""
        if self._hosts is None and hosts not in (None, 1):
            raise ValueError(
                f"mesh '{name}' asks for hosts={hosts}, but no provisioner.hosts are configured: "
                "start `python -m forge.worker` on each host and list their addresses there"
            )
        if self._hosts is not None:
            record = await self._spawn_on_hosts(
                procs, hosts or 1, with_gpus, name, self._seed_of(name), gpu_group
            )
        else:
            async with self._lock:
                gpus = self._gpus_for(procs, name, gpu_group) if with_gpus else []
                visible = gpus + [g for g in self._all_gpus if g not in gpus] if gpus else []
                bootstrap = functools.partial(
                    mesh_process.start, procs, _free_port(), visible, self._seed_of(name), for_forge_actor
                )
                mesh = this_host().spawn_procs(per_host={"procs": procs}, bootstrap=bootstrap, name=name)
                record = _MeshRecord(mesh, name, gpus, gpu_group)
        record.metrics = collect_metrics
        self._meshes.append(record)
        await record.mesh.initialized
        if collect_metrics:
            await register_mesh(name, record.mesh)
        logger.info(
            "started mesh %s: %d procs, gpus=%s", name, procs, record.gpus or record.host_gpus or "none"
        )
        return record.mesh

    def _seed_of(self, name: str) -> int | None:
        return None if self.seed is None else mesh_seed(self.seed, name)

    async def _spawn_on_hosts(
        self, procs: int, count: int, with_gpus: bool, name: str, seed: int | None, gpu_group: str | None
    ) -> _MeshRecord:
        assert self._hosts is not None
        async with self._lock:
            hosts = self._hosts.hosts_for(name, count)
            gpus = self._hosts.take_gpus(hosts, procs, name, gpu_group) if with_gpus else [[] for _ in hosts]
        try:
            mesh, where = await self._hosts.spawn(hosts, procs, gpus, name, seed)
        except BaseException:
            self._hosts.give_back_gpus(hosts, gpus, gpu_group)
            raise
        places = ", ".join(f"host {h} ({self.cfg.hosts[h]})" for h in hosts)
        supervision.describe(name, f"on {places}")
        return _MeshRecord(mesh, name, gpu_group=gpu_group, hosts=hosts, host_gpus=gpus, where=where)

    def report_placement(self, path: Path) -> str:
        """Writes `placement()` to `path` as JSON and returns it as lines to print."""
        report = self.placement()
        path.write_text(json.dumps(report, indent=1))
        lines = []
        for mesh in report:
            pids = ",".join(str(p["pid"]) for p in mesh["procs"])
            hostnames = ",".join(sorted({p["hostname"] for p in mesh["procs"]}))
            lines.append(f"{mesh['mesh']:<24} hosts {mesh['hosts']} {hostnames} pids {pids}")
        return "\n".join(lines)

    def placement(self) -> list[dict]:
        """Where each live mesh runs: name, host indices and addresses, and per process its
        host name, pid and parent pid (the worker's, on a worker)."""
        return [
            {
                "mesh": r.name,
                "hosts": r.hosts,
                "addresses": [self.cfg.hosts[h] for h in r.hosts],
                "procs": r.where,
            }
            for r in self._meshes
            if r.hosts
        ]

    def _gpus_for(self, procs: int, name: str, gpu_group: str | None) -> list[str]:
        if not self._all_gpus:
            logger.warning("mesh %s asked for GPUs but this machine has none: running on CPU", name)
        return self._pool.take(procs, name, gpu_group)

    def _record_of(self, mesh: ProcMesh) -> _MeshRecord | None:
        return next((r for r in self._meshes if r.mesh is mesh), None)

    def note_processes(self, mesh: ProcMesh, processes: list[tuple[str, int]]) -> None:
        """Records where `mesh`'s processes run, (host name, pid) each, for `kill_proc_mesh`."""
        record = self._record_of(mesh)
        if record is not None:
            record.processes = list(processes)

    def kill_proc_mesh(self, mesh: ProcMesh) -> None:
        """SIGKILLs `mesh`'s processes (one that hangs cannot be stopped politely); supervision
        then reports their death, and `stop_proc_mesh` still has to forget the mesh."""
        record = self._record_of(mesh)
        if record is not None:
            kill_processes(record.processes, record.name)

    async def stop_proc_mesh(self, mesh: ProcMesh) -> None:
        record = self._record_of(mesh)
        if record is None:
            return
        self._meshes.remove(record)
        self._pool.give_back(record.gpus, record.gpu_group)
        if self._hosts is not None and record.hosts:
            self._hosts.give_back_gpus(record.hosts, record.host_gpus, record.gpu_group)
        if record.metrics:
            await unregister_mesh(record.name)
        # Its processes end now; Monarch may report that after the program moved on.
        supervision.stopped_on_purpose(record.name)
        try:
            await asyncio.wait_for(mesh.stop(), self.cfg.stop_timeout_s)
        except TimeoutError:
            # A process that does not exit when asked would outlive the program and hold its GPU.
            logger.warning(
                "mesh %s did not stop within %g s; killing its processes",
                record.name,
                self.cfg.stop_timeout_s,
            )
            kill_processes(record.processes, record.name)
        except Exception as e:  # a mesh whose process already died cannot stop cleanly
            logger.warning("mesh %s did not stop cleanly: %s", record.name, e)

    def add_supervisor(self, stop: Callable[[], Awaitable[None]]) -> None:
        """`stop` runs at shutdown before any mesh stops (a service's `stop`)."""
        self._supervisors.append(stop)

    def remove_supervisor(self, stop: Callable[[], Awaitable[None]]) -> None:
        if stop in self._supervisors:
            self._supervisors.remove(stop)

    async def stop_supervisors(self) -> None:
        """Stops the services (their replicas with them): call it before stopping what their
        replacements would need, such as the weight store. At once: a service whose mesh takes
        `stop_timeout_s` to give up must not hold up the others."""
        await asyncio.gather(*(stop() for stop in list(self._supervisors)))

    async def shutdown(self) -> None:
        """Stops the supervisors (so that none replaces a replica as it stops), then every
        mesh at once: each stop waits about a second for its process to exit, and nothing
        runs on the actors any more that could need another mesh."""
        await self.stop_supervisors()
        await asyncio.gather(*(self.stop_proc_mesh(record.mesh) for record in list(self._meshes)))


_provisioner: Provisioner | None = None


async def init_provisioner(
    cfg: ProvisionerConfig | None = None, seed: int | None = None, plan: GpuPlan | None = None
) -> Provisioner:
    """The program's provisioner; `seed` seeds the global RNGs of every process it starts, and
    `plan` places its GPU meshes. With `cfg.hosts`, attached to those workers (call it before
    anything else uses Monarch: it chooses Monarch's transport)."""
    global _provisioner
    if _provisioner is None:
        _provisioner = Provisioner(cfg, seed, plan)
    await _provisioner.attach_hosts()
    return _provisioner


async def get_provisioner() -> Provisioner:
    return await init_provisioner()


async def shutdown() -> None:
    global _provisioner
    if _provisioner is not None:
        await _provisioner.shutdown()
        _provisioner = None
