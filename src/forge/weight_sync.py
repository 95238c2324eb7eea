"""Weight sync: the trainer publishes policy versions, generators pick up the newest complete one.

    trainer   (WeightPublisher): publish(v, state_dict) copies the weights into a snapshot
              now, then stores the snapshot in the background while the next train step
              runs, then deletes versions older than the newest `keep`.
    generator (WeightPuller):    pull_newest(into) loads the newest complete version between
              requests; it never waits for one unless told a minimum version.

The store (`forge.store`, over TorchStore) is the directory: a version becomes visible when
its manifest, written last, exists, so a reader never mixes two versions. It is also the
data path today. A faster transport (CUDA IPC between processes on one GPU, an NCCL
broadcast from trainer to generators) plugs in as another `Transport`: it moves the tensors
its own way and keeps using the store's manifests as the directory, so the publisher, the
puller and their callers do not change.

Each sync reports its bytes, seconds and GB/s: `weight_sync/publish_*` from the trainer,
`weight_sync/pull_*` from each generator.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

import torch

from forge import store
from forge.observability import Reduce, record_metric


class Transport(Protocol):
    async def put(self, version: int, state_dict: dict[str, torch.Tensor]) -> None: ...
    async def get(self, version: int, into: dict[str, torch.Tensor]) -> None: ...
    async def delete(self, version: int) -> None: ...
    async def versions(self) -> list[int]: ...


class StoreTransport:
    """Tensors through TorchStore (host memory, Monarch messages)."""

    async def put(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        await store.put_state_dict(version, state_dict)

    async def get(self, version: int, into: dict[str, torch.Tensor]) -> None:
        await store.get_state_dict(version, into=into)

    async def delete(self, version: int) -> None:
        await store.delete(version)

    async def versions(self) -> list[int]:
        return await store.versions()


def _nbytes(state_dict: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state_dict.values())


def _record_sync(kind: str, nbytes: int, seconds: float) -> None:
    record_metric(f"weight_sync/{kind}_bytes", nbytes, Reduce.MEAN)
    record_metric(f"weight_sync/{kind}_s", seconds, Reduce.MEAN)
    record_metric(f"weight_sync/{kind}_gb_per_s", nbytes / max(seconds, 1e-9) / 1e9, Reduce.MEAN)


class WeightPublisher:
    """Trainer side. One publish in flight at a time: the snapshot buffers are reused, so a
    publish first waits for the previous one to be stored (normally long done)."""

    def __init__(self, keep: int = 2, transport: Transport | None = None):
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (the newest version is always kept), got {keep}")
        self.keep = keep
        self.transport = transport or StoreTransport()
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._in_flight: asyncio.Task | None = None

    async def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Copies `state_dict` now (the caller may change its tensors as soon as this returns)
        and stores it as `version` in the background."""
        await self.wait()
        started = time.perf_counter()
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
        record_metric("weight_sync/snapshot_s", time.perf_counter() - started, Reduce.MEAN)
        self._in_flight = asyncio.create_task(self._store(version, self._snapshot))

    async def _store(self, version: int, snapshot: dict[str, torch.Tensor]) -> None:
        started = time.perf_counter()
        await self.transport.put(version, snapshot)
        _record_sync("publish", _nbytes(snapshot), time.perf_counter() - started)
        for old in (await self.transport.versions())[: -self.keep]:
            try:
                await self.transport.delete(old)
            except store.VersionNotFoundError:  # already gone
                pass

    async def wait(self) -> None:
        """Until the last publish is stored; raises its error if it failed."""
        if self._in_flight is not None:
            task, self._in_flight = self._in_flight, None
            await task


class WeightPuller:
    """Generator side: loads versions into the engine's receive buffers (`into`)."""

    def __init__(self, transport: Transport | None = None, poll_s: float = 0.005):
        self.transport = transport or StoreTransport()
        self.poll_s = poll_s

    async def newest(self) -> int | None:
        published = await self.transport.versions()
        return published[-1] if published else None

    async def pull(self, version: int, into: dict[str, torch.Tensor]) -> None:
        """Loads exactly `version`, waiting for it to be published."""
        while version not in await self.transport.versions():
            await asyncio.sleep(self.poll_s)
        started = time.perf_counter()
        await self.transport.get(version, into)
        _record_sync("pull", _nbytes(into), time.perf_counter() - started)

    async def pull_newest(
        self, current: int, into: dict[str, torch.Tensor], min_version: int = 0
    ) -> int | None:
        """Loads the newest complete version if it is newer than `current`, waiting until one
        is at least `min_version`. Returns the version loaded, or None."""
        loaded = None
        while True:
            newest = await self.newest()
            if newest is not None and newest > current:
                started = time.perf_counter()
                try:
                    await self.transport.get(newest, into)
                except store.VersionNotFoundError:
                    continue  # deleted while read: a newer one exists
                _record_sync("pull", _nbytes(into), time.perf_counter() - started)
                loaded = current = newest
            if current >= min_version:
                return loaded
            await asyncio.sleep(self.poll_s)
