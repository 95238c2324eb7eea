"""GPU work in threads makes its process's device current first (forge.cuda_threads). CUDA
cannot run here, so `torch.cuda.set_device` is replaced by a recorder; bench/RESULTS.md (issue
28, fifteenth session) has the GPU run: no trainer rank holds a context on another rank's GPU."""

import asyncio
import threading

import torch

from forge.cuda_threads import to_thread_on


def test_the_thread_makes_the_device_current_before_the_work(monkeypatch):
    made = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: made.append((threading.get_ident(), device)))

    def work(x: int) -> tuple[int, int, int]:
        return threading.get_ident(), len(made), 2 * x

    thread, devices_made_before, value = asyncio.run(to_thread_on(torch.device("cuda", 1), work, 21))
    assert value == 42 and thread != threading.get_ident()
    assert made == [(thread, torch.device("cuda", 1))] and devices_made_before == 1
    made.clear()
    asyncio.run(to_thread_on(torch.device("cpu"), work, 1))
    assert made == []  # nothing to make current off CUDA
