"""Hosts beyond this one: attaching to `python -m forge.worker` processes and placing meshes there.

The controller (this process) attaches to one worker per host. Which hosts a mesh uses
comes from `provisioner.placement`, keyed by the actor's name (its class name, e.g.
`TitanTrainer`, `Generator`; `torchstore` for the storage volume): successive meshes of the
same name (a service's replicas) take the listed hosts in turn, `hosts` at a time.

A process spawned on a worker inherits the worker's environment, so everything the
controller would set for it (ranks, GPUs, the torch.distributed rendezvous) is set
explicitly: ranks and GPUs by the mesh's bootstrap, the rendezvous address and port by a
small `HostAgent` actor once the processes exist, because only a process on the mesh's
first host can pick a port that is free there.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import glob
import logging
import os
import socket
from collections import defaultdict
from collections.abc import Callable
from urllib.parse import urlsplit

from monarch.actor import Actor, HostMesh, ProcMesh, attach_to_workers, current_rank, endpoint

from forge import mesh_process
from forge.controller.gpu_pool import GpuPool

logger = logging.getLogger(__name__)

HOST_AGENT_NAME = "forge_host_agent"
STORE_MESH_NAME = "torchstore"


class HostUnreachableError(ConnectionError):
    """A host worker could not be reached, or stopped answering."""


def parse_worker_address(address: str) -> tuple[str, str, int]:
    """(scheme, host, port) of a worker address `tls://host:port` or `tcp://host:port`."""
    parts = urlsplit(address)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("tls", "tcp") or not parts.hostname or port is None or parts.path:
        raise ValueError(
            f"worker address '{address}' is not of the form tls://HOST:PORT or tcp://HOST:PORT "
            "(as printed by `python -m forge.worker`)"
        )
    return parts.scheme, parts.hostname, port


def check_reachable(addresses: list[str], timeout_s: float) -> None:
    """Fails fast, naming the address, when a worker's port does not accept a connection
    (Monarch itself would wait for it forever)."""
    for index, address in enumerate(addresses):
        _, host, port = parse_worker_address(address)
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                pass
        except OSError as e:
            raise HostUnreachableError(
                f"provisioner.hosts[{index}]: worker {address} is unreachable ({e}). Is "
                f"`python -m forge.worker --port {port}` running on {host}, and is the port open?"
            ) from None


def _gpus_here() -> list[str]:
    """The GPUs this process may use, without initialising CUDA in it."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g for g in env.split(",") if g.strip()]
    return sorted((p.removeprefix("/dev/nvidia") for p in glob.glob("/dev/nvidia[0-9]*")), key=int)


class HostAgent(Actor):
    """Runs beside a mesh's actors on each of its processes: reports where it runs and
    sets the torch.distributed rendezvous before the real actor is spawned."""

    @endpoint
    async def where(self) -> dict:
        return {
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "rank": current_rank().rank,
        }

    @endpoint
    async def gpus(self) -> list[str]:
        return _gpus_here()

    @endpoint
    async def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    @endpoint
    async def set_env(self, env: dict[str, str]) -> None:
        os.environ.update(env)


# Controller settings that its actors' processes must share wherever they run.
FORWARDED_ENV = ("OMP_NUM_THREADS",)


def set_rank_env(
    procs_per_host: int, gpus_by_host: list[list[str]], forwarded: dict[str, str], seed: int | None
) -> None:
    """Bootstrap of a mesh on workers: ranks over hosts x procs, this host's GPUs, the
    controller's settings in FORWARDED_ENV, and the process's RNG seed."""
    mesh_process.enter(defer_gc=False)
    point = current_rank()
    host = dict(point).get("hosts", 0)
    local = dict(point).get("procs", 0)
    os.environ.update(forwarded)
    os.environ.update(
        RANK=str(point.rank),
        WORLD_SIZE=str(procs_per_host * len(gpus_by_host)),
        LOCAL_RANK=str(local),
        LOCAL_WORLD_SIZE=str(procs_per_host),
        CUDA_VISIBLE_DEVICES=",".join(gpus_by_host[host]),
    )
    mesh_process.seed_rngs(seed, point.rank)


class AttachedHosts:
    """The workers this controller attached to, their GPUs, and which meshes run where."""

    def __init__(self, addresses: list[str], placement_for: Callable[[str], list[int]]):
        self.addresses = addresses
        self.placement_for = placement_for
        self.mesh: HostMesh | None = None
        self.hostnames: list[str] = []
        self.pools: list[GpuPool] = []
        self._turns: dict[str, int] = defaultdict(int)

    async def attach(self, timeout_s: float) -> None:
        check_reachable(self.addresses, timeout_s)
        self.mesh = attach_to_workers(ca="trust_all_connections", workers=self.addresses, name="forge_hosts")
        # One process per host, to learn its name and GPUs; a worker that accepted the TCP
        # connection but does not speak Monarch (or rejects our certificate) hangs here.
        probe = self.mesh.spawn_procs(per_host={"procs": 1}, name="forge_probe")
        try:
            agents = probe.spawn(HOST_AGENT_NAME, HostAgent)
            where, gpus = await _within(
                asyncio.gather(agents.where.call(), agents.gpus.call()),
                timeout_s,
                f"the workers {self.addresses} accepted a connection but did not start a process "
                f"within {timeout_s:.0f} s: check that each runs `python -m forge.worker` with the same "
                "transport as provisioner.hosts (tls:// or tcp://) and, for TLS, certificates signed "
                "by the same CA as this controller's",
            )
        finally:
            # Bounded: a probe that never started may not answer a stop either.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(probe.stop(), timeout_s)
        self.hostnames = [w["hostname"] for w in where.values()]
        self.pools = [
            GpuPool(host_gpus, where=f" on host {index} ({address})")
            for index, (address, host_gpus) in enumerate(zip(self.addresses, gpus.values(), strict=True))
        ]
        for index, (address, name) in enumerate(zip(self.addresses, self.hostnames, strict=True)):
            logger.info("attached host %d: %s (%s), GPUs %s", index, address, name, self.pools[index].gpus)

    def hosts_for(self, mesh_name: str, count: int) -> list[int]:
        """The `count` consecutive host indices the next mesh named `mesh_name` goes to."""
        actor = actor_name(mesh_name)
        listed = self.placement_for(actor)
        if count > len(listed):
            raise ValueError(
                f"mesh '{mesh_name}' spans {count} hosts but provisioner.placement.{actor} lists "
                f"{len(listed)}: {listed}"
            )
        turn = self._turns[actor]
        self._turns[actor] += 1
        start = (turn * count) % len(listed)
        chosen = (listed + listed)[start : start + count]
        if chosen != list(range(chosen[0], chosen[0] + count)):
            raise ValueError(
                f"mesh '{mesh_name}' spans hosts {chosen}, which are not consecutive: list them in "
                f"order in provisioner.placement.{actor}"
            )
        return chosen

    def take_gpus(
        self, hosts: list[int], procs: int, name: str, gpu_group: str | None = None
    ) -> list[list[str]]:
        """`procs` GPUs on each host (none on a host without GPUs), from each host's pool
        (`forge.controller.gpu_pool`): a sharing group shares GPUs between meshes that span the
        same hosts (the reference model on the trainer's GPUs)."""
        taken: list[list[str]] = []
        try:
            for host in hosts:
                taken.append(self.pools[host].take(procs, name, gpu_group, tuple(hosts)))
        except RuntimeError:
            self.give_back_gpus(hosts[: len(taken)], taken, gpu_group)
            raise
        return taken

    def give_back_gpus(self, hosts: list[int], gpus: list[list[str]], gpu_group: str | None = None) -> None:
        """What `take_gpus` gave a mesh; a GPU is free again once no mesh holds it."""
        for host, given in zip(hosts, gpus, strict=True):
            self.pools[host].give_back(given, gpu_group)

    @property
    def free_gpus(self) -> list[list[str]]:
        return [pool.free for pool in self.pools]

    async def spawn(
        self, hosts: list[int], procs: int, gpus: list[list[str]], name: str, seed: int | None
    ) -> tuple:
        """A proc mesh of `procs` processes on each of `hosts`, rendezvous set; returns it and
        where each process runs."""
        assert self.mesh is not None
        host_mesh = self.mesh.slice(hosts=slice(hosts[0], hosts[-1] + 1))
        forwarded = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
        bootstrap = functools.partial(set_rank_env, procs, gpus, forwarded, seed)
        mesh: ProcMesh = host_mesh.spawn_procs(per_host={"procs": procs}, bootstrap=bootstrap, name=name)
        agents = mesh.spawn(HOST_AGENT_NAME, HostAgent)
        # Every process offers a port; rank 0's (on the first host) is the rendezvous.
        port = next(iter((await agents.free_port.call()).values()))
        _, master, _ = parse_worker_address(self.addresses[hosts[0]])
        await agents.set_env.call({"MASTER_ADDR": master, "MASTER_PORT": str(port)})
        where = list((await agents.where.call()).values())
        for w in where:
            w["host"] = hosts[0] + w["rank"] // procs
            w["address"] = self.addresses[w["host"]]
        return mesh, where


def actor_name(mesh_name: str) -> str:
    """The placement key of a mesh: its name without the `_<n>` that makes it unique."""
    base, _, suffix = mesh_name.rpartition("_")
    return base if base and suffix.isdigit() else mesh_name


async def _within(awaitable, timeout_s: float, message: str):
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError:
        raise HostUnreachableError(message) from None
