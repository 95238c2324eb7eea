"""forge.store across processes: bit-identical in-place reads, deletion, no partial versions."""

import asyncio

import pytest
import torch
from monarch.actor import endpoint

from forge import store
from forge.controller import ForgeActor

pytestmark = pytest.mark.slow


def make_state_dict(seed: int, scale: int = 1) -> dict[str, torch.Tensor]:
    """About 10M parameters in a few shapes and dtypes, reproducible from the seed."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(4096, 1024 * scale, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(1024, 4096, generator=g).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.randn(1024, generator=g),
        "model.layers.1.self_attn.q_proj.weight": torch.randn(1024, 1024, generator=g),
        "lm_head.weight": torch.randn(1024, 1024, generator=g),
    }


class Writer(ForgeActor):
    @endpoint
    async def put(self, version: int, seed: int) -> int:
        sd = make_state_dict(seed)
        await store.put_state_dict(version, sd)
        return sum(t.numel() for t in sd.values())

    @endpoint
    async def put_filled(self, versions: list[int], num_tensors: int) -> None:
        """Publishes versions whose every tensor is filled with the version number."""
        for v in versions:
            await store.put_state_dict(v, {f"w{i}": torch.full((256,), float(v)) for i in range(num_tensors)})


class Reader(ForgeActor):
    @endpoint
    async def get_and_compare(self, version: int, seed: int) -> dict:
        expected = make_state_dict(seed)
        buffers = {k: torch.zeros_like(v) for k, v in expected.items()}
        pointers = {k: v.data_ptr() for k, v in buffers.items()}
        out = await store.get_state_dict(version, into=buffers)
        return {
            "identical": all(torch.equal(out[k], expected[k]) for k in expected),
            "in_place": out is buffers and all(out[k].data_ptr() == p for k, p in pointers.items()),
        }

    @endpoint
    async def poll_versions(self, until: int, num_tensors: int) -> list[int]:
        """Reads every version as soon as it is listed; returns those seen, fails on a mixed one."""
        seen: list[int] = []
        buffers = {f"w{i}": torch.empty(256) for i in range(num_tensors)}
        while not seen or seen[-1] < until:
            latest = await store.latest_version()
            if latest is not None and (not seen or latest > seen[-1]):
                await store.get_state_dict(latest, into=buffers)
                values = {float(t[0]) for t in buffers.values()} | {float(t[-1]) for t in buffers.values()}
                if values != {float(latest)}:
                    raise AssertionError(f"version {latest} read as a mix of {sorted(values)}")
                seen.append(latest)
            await asyncio.sleep(0)
        return seen


@pytest.fixture(scope="module")
def actors(module_store):
    """A writer and a reader, each in a process of its own, for the module's tests."""

    async def spawn():
        return await asyncio.gather(Writer.as_actor(), Reader.as_actor())

    return module_store.run(spawn())


def test_put_get_delete_across_processes(in_store, actors):
    writer, reader = actors

    async def main():
        numel = await writer.put.route(version=1, seed=11)
        assert numel > 10_000_000
        await writer.put.route(version=2, seed=22)
        assert await store.versions() == [1, 2]
        assert await store.latest_version() == 2

        result = await reader.get_and_compare.route(version=2, seed=22)
        assert result == {"identical": True, "in_place": True}
        # Each version keeps its own tensors.
        assert (await reader.get_and_compare.route(version=1, seed=11))["identical"]

        await store.delete(1)
        assert await store.versions() == [2]
        with pytest.raises(store.VersionNotFoundError, match=r"weight version 1 is not in the store.*\[2\]"):
            await store.get_state_dict(1)
        # The remaining version is untouched by the deletion.
        assert (await reader.get_and_compare.route(version=2, seed=22))["identical"]

        # A receiving buffer of the wrong shape is refused before anything is copied.
        buffers = {k: torch.zeros_like(v) for k, v in make_state_dict(0).items()}
        buffers["lm_head.weight"] = torch.zeros(3, 3)
        with pytest.raises(ValueError, match=r"'lm_head.weight': stored as \(1024, 1024\)"):
            await store.get_state_dict(2, into=buffers)
        del buffers["lm_head.weight"]
        with pytest.raises(KeyError, match="missing from it"):
            await store.get_state_dict(2, into=buffers)

    in_store(main())


def test_reader_racing_writer_never_sees_a_partial_version(in_store, actors):
    writer, reader = actors
    num_tensors, last = 40, 6

    async def main():
        polling = asyncio.ensure_future(reader.poll_versions.route(until=last, num_tensors=num_tensors))
        await writer.put_filled.route(list(range(1, last + 1)), num_tensors)
        seen = await asyncio.wait_for(polling, 120)
        assert seen[-1] == last and seen == sorted(set(seen))

    in_store(main())
