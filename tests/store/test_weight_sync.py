"""WeightPublisher / WeightPuller over the real store: snapshot semantics, background store,
old versions deleted, the newest complete version picked up, metrics of each sync."""

import asyncio

import pytest
import torch

from forge import store
from forge.controller import shutdown
from forge.observability.collector import pop_state
from forge.weight_sync import WeightPublisher, WeightPuller


def weights(value: float) -> dict[str, torch.Tensor]:
    return {"a.weight": torch.full((64, 32), value), "b.bias": torch.full((32,), value).to(torch.bfloat16)}


def test_publish_in_background_pull_newest_and_keep():
    async def main():
        await store.initialize()
        try:
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
        finally:
            await store.shutdown()
            await shutdown()

    asyncio.run(main())


def test_small_objects_are_versioned_under_their_own_prefix():
    # How CudaIpcTransport publishes a version: its handle, as one object, beside the tensors' versions.
    async def main():
        await store.initialize()
        try:
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
        finally:
            await store.shutdown()
            await shutdown()

    asyncio.run(main())
