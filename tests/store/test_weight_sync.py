"""WeightPublisher / WeightPuller over the real store: snapshot semantics, background store,
old versions deleted, the newest complete version picked up, metrics of each sync, verify mode."""

import asyncio

import pytest
import torch

from forge import store
from forge.fingerprint import checksum
from forge.observability.collector import pop_state
from forge.weight_sync import WeightMismatchError, WeightPublisher, WeightPuller
from forge.weight_transports import StoreTransport, build_transport


def weights(value: float) -> dict[str, torch.Tensor]:
    return {"a.weight": torch.full((64, 32), value), "b.bias": torch.full((32,), value).to(torch.bfloat16)}


def test_publish_in_background_pull_newest_and_keep(in_store):
    async def main():
        publisher, puller = WeightPublisher(keep=2), WeightPuller()
        into = {k: torch.empty_like(v) for k, v in weights(0.0).items()}
        live = weights(1.0)
        await publisher.publish(1, live)
        live["a.weight"].fill_(-5.0)  # the trainer's next step may change them at once
        await publisher.wait()
        assert await puller.pull_newest(0, into) == 1
        assert torch.equal(into["a.weight"], weights(1.0)["a.weight"])
        assert await puller.pull_newest(1, into) is None  # nothing newer

        for version in (2, 3):
            await publisher.publish(version, weights(float(version)))
        await publisher.wait()
        assert await store.versions() == [2, 3]  # keep=2 deleted version 1

        # A request that needs version 4 waits for it.
        waiting = asyncio.create_task(puller.pull_newest(1, into, min_version=4))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await publisher.publish(4, weights(4.0))
        assert await waiting == 4 and torch.equal(into["b.bias"], weights(4.0)["b.bias"])
        await puller.pull(3, into)
        assert torch.equal(into["a.weight"], weights(3.0)["a.weight"])

        metrics = {k: acc.value() for k, acc in pop_state().items()}
        nbytes = 64 * 32 * 4 + 32 * 2
        assert metrics["weight_sync/publish_bytes"] == metrics["weight_sync/pull_bytes"] == nbytes
        assert metrics["weight_sync/publish_gb_per_s"] > 0 and metrics["weight_sync/pull_s"] > 0

    in_store(main())


def test_small_objects_are_versioned_under_their_own_prefix(in_store):
    # How IpcTransport publishes a version: its handle, as one object, beside the tensors' versions.
    async def main():
        await store.put_object(3, {"handle": b"\x01\x02"}, "policy_ipc")
        await store.put_object(4, {"handle": b"\x03"}, "policy_ipc")
        assert await store.versions("policy_ipc") == [3, 4]
        assert await store.versions() == []  # the tensor versions are another directory
        assert await store.get_object(4, "policy_ipc") == {"handle": b"\x03"}
        await store.delete_object(3, "policy_ipc")
        assert await store.versions("policy_ipc") == [4]
        with pytest.raises(
            store.VersionNotFoundError,
            match=r"version 3 is not in the store \(published under 'policy_ipc': \[4\]\)",
        ):
            await store.get_object(3, "policy_ipc")

    in_store(main())


def test_checksum_is_exact_and_sees_moved_bytes():
    sd = weights(0.5) | {"c.weight": torch.arange(12.0).reshape(3, 4)}
    same = {n: t.clone() for n, t in sd.items()}
    assert checksum(sd) == checksum(same)
    # A permutation keeps a plain byte sum but not this checksum; so does a one-ulp change.
    swapped = dict(same, **{"c.weight": same["c.weight"].flip(0)})
    assert checksum(swapped) != checksum(sd)
    nudged = dict(
        same, **{"b.bias": torch.nextafter(same["b.bias"], torch.tensor(1e9, dtype=torch.bfloat16))}
    )
    assert checksum(nudged) != checksum(sd)
    # Chunking does not change the value.
    assert checksum(sd, chunk=7) == checksum(sd)


class OneBitFlipTransport(StoreTransport):
    """The real store path, with one received bit flipped from `bad_version` on: a transport bug."""

    def __init__(self, bad_version: int):
        super().__init__()
        self.bad_version = bad_version

    async def get(self, version: int, into: dict[str, torch.Tensor]) -> None:
        await super().get(version, into)
        if version >= self.bad_version:
            into["a.weight"].view(torch.int32)[7, 3] ^= 1


def test_verify_mode_passes_exact_copies_and_names_a_corrupted_version(in_store):
    async def main():
        publisher = WeightPublisher(keep=1, verify=True)
        puller = WeightPuller(OneBitFlipTransport(bad_version=3), verify=True)
        into = {k: torch.empty_like(v) for k, v in weights(0.0).items()}
        for version in (1, 2):
            await publisher.publish(version, weights(float(version)))
            await publisher.wait()
            assert await puller.pull_newest(version - 1, into) == version
        # The checksums are versioned beside the weights and deleted with them.
        assert await store.versions("policy_checksum") == [2]
        assert "weight_sync/verify_s" in pop_state()

        await publisher.publish(3, weights(3.0))
        await publisher.wait()
        with pytest.raises(
            WeightMismatchError,
            match=r"weight version 3: the received weights' checksum is \d+, the trainer published \d+",
        ):
            await puller.pull_newest(2, into)
        # Without verify mode the same flip would pass unnoticed.
        assert await WeightPuller(OneBitFlipTransport(bad_version=3)).pull_newest(2, into) == 3

    in_store(main())


def test_a_version_that_never_comes_fails_naming_the_transport_setting(in_store):
    async def main():
        await WeightPublisher().publish(1, weights(1.0))
        # The generator looks on another transport than the trainer published on.
        puller = WeightPuller(build_transport("shm"), wait_timeout_s=0.2)
        into = {k: torch.empty_like(v) for k, v in weights(0.0).items()}
        with pytest.raises(
            TimeoutError,
            match=r"weight version 1 was not published through IpcTransport.*generator.weight_transport",
        ):
            await puller.pull(1, into)
        with pytest.raises(TimeoutError, match=r"weight version 1 was not published"):
            await puller.pull_newest(0, into, min_version=1)
        # An actor left at `auto` builds the store transport, as the trainer does by default.
        assert await WeightPuller(build_transport("auto")).pull_newest(0, into, min_version=1) == 1

    in_store(main())
