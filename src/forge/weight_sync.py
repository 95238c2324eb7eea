"""Weight sync: the trainer publishes policy versions, generators pick up the newest complete one.

    trainer   (WeightPublisher): publish(v, state_dict) copies the weights into a snapshot
              now, then stores the snapshot in the background while the next train step
              runs, then deletes versions older than the newest `keep`.
    generator (WeightPuller):    pull_newest(into) loads the newest complete version between
              requests; it never waits for one unless told a minimum version.

The store (`forge.store`, over TorchStore) is the directory: a version becomes visible when
its manifest, written last, exists, so a reader never mixes two versions. How the tensors
travel is the transport's business (`forge.weight_transports`), so the publisher, the puller
and their callers do not change with it.

With LoRA the trainer publishes its adapters alone (`forge.engines.lora_sync`): the same
versions, keys and checksums, a few tens of MB where the model is GBs.

Each sync reports its bytes, seconds and GB/s: `weight_sync/publish_*` from the trainer,
`weight_sync/pull_*` from each generator. Verify mode (`generator.verify_weights`) also stores
an exact checksum of each version's bytes beside it, and the puller compares it with the
checksum of what it received: a transport that corrupts, truncates or mixes versions fails the
run with the version and both sums, instead of training on a policy nobody published.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import torch

from forge import store
from forge.fingerprint import checksum
from forge.observability import Reduce, record_metric
from forge.weight_transports import BroadcastTransport, IpcTransport, StoreTransport, Transport

CHECKSUM_PREFIX = "policy_checksum"


class PullerStopped(RuntimeError):
    """A wait for a weight version ended because the generator is stopping."""


class WeightMismatchError(RuntimeError):
    """What a generator received is not byte for byte what the trainer published."""


def _nbytes(state_dict: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state_dict.values())


def _record_sync(kind: str, nbytes: int, seconds: float) -> None:
    record_metric(f"weight_sync/{kind}_bytes", nbytes, Reduce.MEAN)
    record_metric(f"weight_sync/{kind}_s", seconds, Reduce.MEAN)
    record_metric(f"weight_sync/{kind}_gb_per_s", nbytes / max(seconds, 1e-9) / 1e9, Reduce.MEAN)


class WeightPublisher:
    """Trainer side. One publish in flight at a time: the snapshot buffers are reused, so a
    publish first waits for the previous one to be stored (normally long done)."""

    def __init__(self, keep: int = 2, transport: Transport | None = None, verify: bool = False):
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (the newest version is always kept), got {keep}")
        self.keep = keep
        self.transport = transport or StoreTransport()
        self.verify = verify
        self._in_flight: asyncio.Task | None = None

    async def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Copies `state_dict` now (the caller may change its tensors as soon as this returns)
        and stores it as `version` in the background."""
        await self.wait()
        await self.transport.ready()
        started = time.perf_counter()
        staged = self.transport.stage(version, state_dict)
        record_metric("weight_sync/snapshot_s", time.perf_counter() - started, Reduce.MEAN)
        # Summed from the caller's tensors, which are what the staged copy holds.
        expected = checksum(state_dict) if self.verify else None
        self._in_flight = asyncio.create_task(self._store(version, staged, expected))

    @property
    def publishes_rows(self) -> bool:
        """Whether each rank of a sharded trainer can publish its own rows (`stage_rows`): on one
        host, where a reader maps every rank's slots, or where every rank broadcasts its own."""
        return isinstance(self.transport, IpcTransport | BroadcastTransport)

    async def stage_rows(
        self, version: int, tensors: dict[str, torch.Tensor], first_rows: dict[str, int]
    ) -> tuple[Any, int | None]:
        """Every rank of a sharded trainer: copies its own rows of each tensor (`first_rows`: where
        they start) into its slot now. Returns what `publish_parts` takes on the first rank: the
        slot's handle and, in verify mode, these rows' share of the version's checksum."""
        await self.wait()
        await self.transport.ready()
        started = time.perf_counter()
        handle = self.transport.stage_rows(version, tensors, first_rows)
        record_metric("weight_sync/snapshot_s", time.perf_counter() - started, Reduce.MEAN)
        return handle, checksum(tensors, first_rows=first_rows) if self.verify else None

    async def publish_parts(self, version: int, parts: list[tuple[Any, int | None]]) -> None:
        """The first rank: stores as `version`, in the background, every rank's `stage_rows`."""
        await self.wait()
        staged = self.transport.parts(version, [handle for handle, _ in parts])
        expected = sum(share for _, share in parts) if self.verify else None
        self._in_flight = asyncio.create_task(self._store(version, staged, expected))

    async def _store(self, version: int, staged: Any, expected: int | None) -> None:
        started = time.perf_counter()
        if expected is not None:  # before the version becomes visible, so a reader finds it
            await store.put_object(version, expected, CHECKSUM_PREFIX)
        await self.transport.put(version, staged)
        _record_sync("publish", self.transport.nbytes(staged), time.perf_counter() - started)
        for old in (await self.transport.versions())[: -self.keep]:
            with contextlib.suppress(store.VersionNotFoundError):  # already gone
                await self.transport.delete(old)
            if self.verify:  # even when the weights were gone already: no checksum outlives them
                with contextlib.suppress(store.VersionNotFoundError):
                    await store.delete_object(old, CHECKSUM_PREFIX)

    async def wait(self) -> None:
        """Until the last publish is stored; raises its error if it failed."""
        if self._in_flight is not None:
            task, self._in_flight = self._in_flight, None
            await task


class WeightPuller:
    """Generator side: loads versions into the engine's receive buffers (`into`)."""

    def __init__(
        self,
        transport: Transport | None = None,
        poll_s: float = 0.005,
        verify: bool = False,
        wait_timeout_s: float = 600.0,
    ):
        self.transport = transport or StoreTransport()
        self.poll_s = poll_s
        self.verify = verify
        # A version that never appears is a wiring fault (the two ends on different transports,
        # or a trainer that died): fail with that, rather than wait forever.
        self.wait_timeout_s = wait_timeout_s
        # When the last version loaded was published (wall clock), if the transport tells.
        self.last_published_at: float | None = None
        self._stopped = False

    def stop(self) -> None:
        """Ends every wait for a version (it raises `PullerStopped`): the process is stopping."""
        self._stopped = True

    async def _wait(self, version: int, since: float, published: list[int]) -> None:
        if self._stopped:
            raise PullerStopped(f"stopped while waiting for weight version {version}")
        if time.monotonic() - since > self.wait_timeout_s:
            raise TimeoutError(
                f"weight version {version} was not published through {type(self.transport).__name__} "
                f"within {self.wait_timeout_s:.0f} s (published there: {published[-5:]}): the trainer "
                "and the generator must use the same generator.weight_transport"
            )
        await asyncio.sleep(self.poll_s)

    async def newest(self) -> int | None:
        await self.transport.ready()
        published = await self.transport.versions()
        return published[-1] if published else None

    async def pull(self, version: int, into: dict[str, torch.Tensor]) -> None:
        """Loads exactly `version`, waiting for it to be published."""
        since = time.monotonic()
        await self.transport.ready()
        while version not in (published := await self.transport.versions()):
            await self._wait(version, since, published)
        await self._load(version, into)

    async def pull_newest(
        self, current: int, into: dict[str, torch.Tensor], min_version: int = 0
    ) -> int | None:
        """Loads the newest complete version if it is newer than `current`, waiting until one
        is at least `min_version`. Returns the version loaded, or None."""
        loaded = failed = None
        since = time.monotonic()
        while True:
            newest = await self.newest()
            if newest is not None and newest > current:
                try:
                    await self._load(newest, into)
                except store.VersionNotFoundError:
                    # Deleted (or its slot reused) while read: a newer one exists. The same
                    # version failing twice is no race but a fault: surface it.
                    if failed == newest:
                        raise
                    failed = newest
                    continue
                loaded = current = newest
            if current >= min_version:
                return loaded
            await self._wait(min_version, since, [] if newest is None else [newest])

    async def _load(self, version: int, into: dict[str, torch.Tensor]) -> None:
        """Copies `version` into `into`, reports the sync, and checks it in verify mode."""
        started = time.perf_counter()
        self.last_published_at = await self.transport.get(version, into)
        _record_sync("pull", _nbytes(into), time.perf_counter() - started)
        await self._verify(version, into)

    async def _verify(self, version: int, received: dict[str, torch.Tensor]) -> None:
        if not self.verify:
            return
        started = time.perf_counter()
        expected = await store.get_object(version, CHECKSUM_PREFIX)
        actual = checksum(received)
        if actual != expected:
            raise WeightMismatchError(
                f"weight version {version}: the received weights' checksum is {actual}, the trainer "
                f"published {expected} ({len(received)} tensors, {_nbytes(received)} bytes): the "
                "transport delivered other bytes; try generator.weight_transport=store to compare"
            )
        record_metric("weight_sync/verify_s", time.perf_counter() - started, Reduce.MEAN)
