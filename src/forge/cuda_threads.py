"""GPU work in threads. CUDA's current device belongs to each thread, and a new thread starts on
device 0. A trainer rank's process sees every GPU of its mesh, its own at index LOCAL_RANK, so
in a worker thread of rank r > 0 each call that names no device (a CUDA event, a synchronize,
a stream) went to rank 0's GPU: on 4 H100s every such rank held a 590 MiB CUDA context there
from its first train step on, and its step timer recorded on GPU 0's stream (bench/RESULTS.md,
issue 28, fifteenth session). Threads that run a process's GPU work make its device current
first."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch


def make_current(device: torch.device) -> None:
    """`device` becomes this thread's current CUDA device (nothing for a CPU device)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


async def to_thread_on(device: torch.device, fn: Callable[..., Any], /, *args: Any) -> Any:
    """`asyncio.to_thread(fn, *args)` with `device` current in the thread."""

    def run() -> Any:
        make_current(device)
        return fn(*args)

    return await asyncio.to_thread(run)
