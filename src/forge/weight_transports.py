"""How a policy version's tensors travel from the trainer to the generators: the transports
behind `forge.weight_sync`'s publisher and puller. Whichever carries the tensors, the store
(`forge.store`) is the directory of versions.

- `StoreTransport`: through the store itself (host memory, Monarch messages); any placement,
  several hosts included. Qwen3-1.7B in bf16 on 2 x H200: 7.2 s.
- `IpcTransport`: on one host, the store holding only a small handle per version; GPU to GPU
  by CUDA IPC (the same model: 0.033 s, bench/RESULTS.md, "Weight sync on one host"), or
  through shared host memory on CPU. A sharded (FSDP) trainer publishes without gathering:
  every rank stages its own rows in its own slots (`stage_rows`), the first rank stores the
  version's handle of all of them (`publish_parts`), and each generator copies every rank's
  rows into place (`forge.store.cuda_ipc.PartsHandle`).
- `BroadcastTransport`: for generators that cannot map the trainer's memory (another host):
  every trainer rank broadcasts its own rows to every replica at once, NCCL on GPUs and gloo on
  CPU, in groups that are formed again when a replica dies or is replaced
  (`forge.store.broadcast`); the store holds only the rendezvous's address. Qwen3-1.7B's size
  to two replicas over NCCL on H200s: 33 ms.

`generator.weight_transport` names one (`build_transport`); `auto` is resolved by the app,
where both ends are known (`resolve_transport`).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Protocol

import torch

from forge import store


class Transport(Protocol):
    async def ready(self) -> None:
        """Before each use: sets up what the transport needs the first time, and on a trainer
        waits until a new version can be staged (`stage` itself must not wait)."""

    def stage(self, version: int, state_dict: dict[str, torch.Tensor]) -> Any:
        """Copies the weights aside now (the trainer changes them next); returns what `put` sends."""

    async def put(self, version: int, staged: Any) -> None: ...
    async def get(self, version: int, into: dict[str, torch.Tensor]) -> float | None:
        """Copies `version` into `into`; returns the wall-clock time its publish started, when
        the transport knows it (one host), else None."""

    async def delete(self, version: int) -> None: ...
    async def versions(self) -> list[int]: ...
    def nbytes(self, staged: Any) -> int: ...


class StoreTransport:
    """Tensors through TorchStore (host memory, Monarch messages): works across hosts."""

    def __init__(self) -> None:
        self._snapshot: dict[str, torch.Tensor] | None = None

    async def ready(self) -> None:
        """Always: the store is the program's, and staging copies into a snapshot of its own."""

    def stage(self, version: int, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._snapshot is None:
            pin = torch.cuda.is_available()
            self._snapshot = {
                name: torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                for name, t in state_dict.items()
            }
        for name, tensor in state_dict.items():
            self._snapshot[name].copy_(tensor.detach(), non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return self._snapshot

    def nbytes(self, staged: dict[str, torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in staged.values())

    async def put(self, version: int, staged: dict[str, torch.Tensor]) -> None:
        await store.put_state_dict(version, staged)

    async def get(self, version: int, into: dict[str, torch.Tensor]) -> None:
        await store.get_state_dict(version, into=into)
        return None  # hosts' clocks may differ: no publish time

    async def delete(self, version: int) -> None:
        await store.delete(version)

    async def versions(self) -> list[int]:
        return await store.versions()


class IpcTransport:
    """Tensors stay in the trainer's process, in a staging slot that generators on the same host
    copy from (`forge.store.cuda_ipc`): its GPU memory by CUDA IPC (`cuda_ipc`), or shared host
    memory on CPU (`shm`). The store holds only each version's small handle, so versions and
    their deletion work as with `StoreTransport`. `cuda_ipc` needs the trainer's GPU visible in
    the generator's process (the provisioner makes it so); both need one host."""

    PREFIX = "policy_ipc"
    # Versions a trainer rank stages at once: a reader of the older one is not overwritten.
    SLOTS = 2

    def __init__(self, device: torch.device, slots: int = SLOTS) -> None:
        from forge.store.cuda_ipc import IpcPublisher, IpcReceiver

        # `slots` versions can be read at once; older handles fail their stamp check.
        self._publisher = IpcPublisher(device, slots=slots)
        self._receiver = IpcReceiver()

    async def ready(self) -> None:
        """Always: slots are made on the first publish, opened on the first read, and a slot
        still read when it is reused fails that read (`StaleSlotError`), not the publish."""

    def stage(self, version: int, state_dict: dict[str, torch.Tensor]):
        from forge.store.cuda_ipc import PartsHandle

        return PartsHandle.whole(self._publisher.publish(version, state_dict))

    def stage_rows(self, version: int, tensors: dict[str, torch.Tensor], first_rows: dict[str, int]):
        """This process's rows of each tensor (one rank of a sharded trainer) into its own slot."""
        from forge.store.cuda_ipc import RowsHandle

        return RowsHandle(self._publisher.publish(version, tensors), first_rows)

    def parts(self, version: int, handles: list) -> Any:
        """What `put` takes for a version every rank staged its rows of (`stage_rows`)."""
        from forge.store.cuda_ipc import PartsHandle

        return PartsHandle(version, tuple(handles))

    def nbytes(self, staged) -> int:
        return staged.nbytes

    async def put(self, version: int, staged) -> None:
        await store.put_object(version, staged, self.PREFIX)

    async def get(self, version: int, into: dict[str, torch.Tensor]) -> float:
        from forge.store.cuda_ipc import StaleSlotError

        handle = await store.get_object(version, self.PREFIX)
        try:
            self._receiver.receive(handle, into)
        except StaleSlotError as e:  # its slot already holds a newer version: read that one
            raise store.VersionNotFoundError(f"weight version {version}: {e}") from None
        return handle.published_at

    async def delete(self, version: int) -> None:
        await store.delete_object(version, self.PREFIX)

    async def versions(self) -> list[int]:
        return await store.versions(self.PREFIX)


class BroadcastTransport:
    """Each trainer rank broadcasts its rows of every version to every generator replica
    (`forge.store.broadcast`): NCCL on GPUs, gloo on CPU; any placement, several hosts
    included. The first trainer rank serves the groups' rendezvous; the store holds its address.
    A generator keeps the newest version received in a buffer of its own and copies from it."""

    PREFIX = "policy_broadcast"

    def __init__(self, rank: int = 0, replica: int | None = None, timeout_s: float = 60.0) -> None:
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self.rank = rank  # of the trainer, when this is a trainer rank
        self.replica = replica  # of the generator, when this is a generator replica
        self.timeout_s = timeout_s
        self._sender = None
        self._receiver = None
        self._published: list[int] = []

    async def ready(self) -> None:
        """A trainer rank starts its sender the first time (the first rank serves the
        rendezvous), then waits for a send in progress; a generator starts receiving once the
        trainer has published the rendezvous's address (until then it has nothing)."""
        await self._connect()
        if self._sender is not None:
            await asyncio.to_thread(self._sender.wait_sent)

    async def _connect(self) -> None:
        from forge.store.broadcast import BroadcastReceiver, BroadcastSender, Rendezvous, this_host

        if self.replica is None and self._sender is None:
            if self.rank == 0:
                rendezvous = Rendezvous(this_host(), 0, serve=True, timeout_s=self.timeout_s)
                await store.put_object(0, list(rendezvous.address), self.PREFIX)
            else:
                rendezvous = Rendezvous(
                    *await self._address(wait_s=self.timeout_s), serve=False, timeout_s=self.timeout_s
                )
            self._sender = BroadcastSender(rendezvous, self.rank, self.device, self.timeout_s)
        elif self.replica is not None and self._receiver is None:
            address = await self._address(wait_s=0)
            if address is not None:
                rendezvous = Rendezvous(*address, serve=False, timeout_s=self.timeout_s)
                self._receiver = BroadcastReceiver(rendezvous, self.replica, self.device, self.timeout_s)

    async def _address(self, wait_s: float) -> tuple[str, int] | None:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return tuple(await store.get_object(0, self.PREFIX))
            except store.VersionNotFoundError:
                if time.monotonic() >= deadline:
                    if wait_s:
                        raise TimeoutError(
                            f"the first trainer rank did not publish the broadcast rendezvous within {wait_s:.0f} s"
                        ) from None
                    return None
                await asyncio.sleep(0.05)

    def stage(self, version: int, state_dict: dict[str, torch.Tensor]):
        return self.parts(version, [self._sender.stage(version, state_dict, dict.fromkeys(state_dict, 0))])

    def stage_rows(self, version: int, tensors: dict[str, torch.Tensor], first_rows: dict[str, int]) -> int:
        return self._sender.stage(version, tensors, first_rows)

    def parts(self, version: int, handles: list[int]) -> tuple[int, int]:
        """Senders and bytes of a version staged on `len(handles)` ranks (`stage_rows`'s bytes)."""
        return len(handles), sum(handles)

    def nbytes(self, staged: tuple[int, int]) -> int:
        return staged[1]

    async def put(self, version: int, staged: tuple[int, int]) -> None:
        self._sender.announce(version, senders=staged[0])
        self._published.append(version)

    async def get(self, version: int, into: dict[str, torch.Tensor]) -> float | None:
        try:
            return await asyncio.to_thread(self._receiver.copy_into, version, into)
        except LookupError as e:  # a newer version replaced it meanwhile: read that one
            raise store.VersionNotFoundError(str(e)) from None

    async def delete(self, version: int) -> None:
        self._published.remove(version)

    async def versions(self) -> list[int]:
        if self.replica is None:
            return list(self._published)
        if self._receiver is None:
            return []
        self._receiver.check()
        return [] if self._receiver.version is None else [self._receiver.version]


def resolve_transport(name: str, one_host: bool = True) -> str:
    """`auto` becomes `cuda_ipc` when this program has GPUs and its actors share one host,
    `shm` when they share one host without GPUs (on Linux), else `store`; other names stay.

    Across hosts `auto` is the store, though `broadcast` is faster there: the store's traffic
    goes over the mesh's channels (mutual TLS with `tls://` workers), while a broadcast opens a
    rendezvous port on the first trainer rank's host and sends the weights unauthenticated and
    unencrypted, which a run should choose for a network it trusts, not get by default."""
    if name != "auto":
        return name
    if not one_host:
        return "store"
    if torch.cuda.is_available():
        return "cuda_ipc"
    return "shm" if hasattr(os, "memfd_create") else "store"


def build_transport(name: str, rank: int = 0, replica: int | None = None) -> Transport:
    """The transport named `store`, `cuda_ipc`, `shm` or `broadcast` (`generator.weight_transport`)
    for trainer rank `rank`, or for generator replica `replica`. Both ends must build the same
    one, so `auto` is resolved only where both are known (the app, with `resolve_transport`); an
    actor left at `auto` takes the store, which works anywhere and is `TitanTrainer`'s default too."""
    if name in ("auto", "store"):
        return StoreTransport()
    if name == "cuda_ipc":
        return IpcTransport(torch.device("cuda", torch.cuda.current_device()))
    if name == "shm":
        return IpcTransport(torch.device("cpu"))
    if name == "broadcast":
        return BroadcastTransport(rank, replica)
    raise ValueError(f"unknown weight transport {name!r}: use 'store', 'cuda_ipc', 'shm' or 'broadcast'")
