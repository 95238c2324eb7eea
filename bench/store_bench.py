"""Weight-store throughput: put from the controller process, get into preallocated tensors
in another process, for state dicts of 10, 100 and 1000 MB (float32 tensors of 2 MB each,
like a model's parameters). Prints a table.

    .venv/bin/python bench/store_bench.py [--sizes 10 100 1000] [--repeats 3]
"""

import argparse
import asyncio
import platform
import time

import torch
from monarch.actor import endpoint

from forge import store
from forge.controller import ForgeActor, shutdown

TENSOR_MB = 2


def state_dict_of(size_mb: int) -> dict[str, torch.Tensor]:
    numel = TENSOR_MB * 2**20 // 4
    return {f"layers.{i}.weight": torch.randn(numel) for i in range(max(1, size_mb // TENSOR_MB))}


class Getter(ForgeActor):
    @endpoint
    async def get(self, version: int, size_mb: int) -> float:
        buffers = {k: torch.empty_like(v) for k, v in state_dict_of(size_mb).items()}
        started = time.perf_counter()
        await store.get_state_dict(version, into=buffers)
        return time.perf_counter() - started


async def main(sizes: list[int], repeats: int) -> None:
    await store.initialize()
    getter = await Getter.as_actor()
    rows = []
    version = 0
    for size_mb in sizes:
        sd = state_dict_of(size_mb)
        actual_mb = sum(t.numel() * t.element_size() for t in sd.values()) / 2**20
        put_s, get_s = [], []
        for _ in range(repeats):
            version += 1
            started = time.perf_counter()
            await store.put_state_dict(version, sd)
            put_s.append(time.perf_counter() - started)
            get_s.append(await getter.get.route(version, size_mb))
            await store.delete(version)
        rows.append(
            (actual_mb, len(sd), actual_mb / min(put_s), actual_mb / min(get_s), min(put_s), min(get_s))
        )
    await Getter.shutdown(getter)
    await store.shutdown()
    await shutdown()

    print(f"forge.store on CPU ({platform.machine()}, {torch.get_num_threads()} threads), best of {repeats}")
    print("| state dict | tensors | put MB/s | get MB/s | put s | get s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for mb, n, put_rate, get_rate, put_t, get_t in rows:
        print(f"| {mb:.0f} MB | {n} | {put_rate:.0f} | {get_rate:.0f} | {put_t:.3f} | {get_t:.3f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.sizes, args.repeats))
