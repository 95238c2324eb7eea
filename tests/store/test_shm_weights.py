"""The shared-host-memory weight path (`weight_transport: shm`) across two real processes: a
reader process maps the trainer's slots through /proc and gets exact copies; a reader of a
slot the trainer has since reused is refused rather than given a mix of two versions; the
memory goes with the trainer's process."""

import multiprocessing as mp
import os

import pytest
import torch

from forge.store.cuda_ipc import IpcPublisher, IpcReceiver, StaleSlotError
from forge.weight_sync import checksum, resolve_transport

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="shm weights need Linux memfd")


def weights(value: float) -> dict[str, torch.Tensor]:
    return {
        "embed.weight": torch.arange(600, dtype=torch.float32).reshape(20, 30) * value,
        "norm.weight": torch.full((30,), value, dtype=torch.bfloat16),
    }


def read_in_child(connection) -> None:
    """Receives handles until None; answers each with the checksum read, or the error's text."""
    receiver = IpcReceiver()
    into = {name: torch.empty_like(t) for name, t in weights(0.0).items()}
    while (handle := connection.recv()) is not None:
        try:
            receiver.receive(handle, into)
            connection.send(checksum(into))
        except StaleSlotError as error:
            connection.send(str(error))


def test_another_process_reads_exact_versions_and_is_refused_a_reused_slot():
    publisher = IpcPublisher("cpu", slots=2)
    parent, child = mp.get_context("spawn").Pipe()
    reader = mp.get_context("spawn").Process(target=read_in_child, args=(child,))
    reader.start()
    try:
        first = publisher.publish(1, weights(1.0))
        assert first.host_path.startswith(f"/proc/{os.getpid()}/fd/")
        parent.send(first)
        assert parent.recv() == checksum(weights(1.0))
        parent.send(publisher.publish(2, weights(2.0)))
        assert parent.recv() == checksum(weights(2.0))
        publisher.publish(3, weights(3.0))  # two slots: version 1's slot now holds version 3
        parent.send(first)
        assert parent.recv() == "weight version 1's staging slot now holds version 3"
        parent.send(None)
        reader.join(timeout=60)
        assert reader.exitcode == 0
    finally:
        reader.kill()


def test_auto_takes_shared_memory_on_one_cpu_host_and_the_store_across_hosts():
    expected_one_host = "cuda_ipc" if torch.cuda.is_available() else "shm"
    assert resolve_transport("auto", one_host=True) == expected_one_host
    assert resolve_transport("auto", one_host=False) == "store"
    assert resolve_transport("store") == "store"
