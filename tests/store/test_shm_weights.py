"""The shared-host-memory weight path (`weight_transport: shm`) across two real processes: a
reader process maps the trainer's slots through /proc and gets exact copies; a reader of a
slot the trainer has since reused is refused rather than given a mix of two versions; the
memory goes with the trainer's process."""

import multiprocessing as mp
import os

import pytest
import torch

from forge.fingerprint import checksum
from forge.store.cuda_ipc import IpcPublisher, IpcReceiver, PartsHandle, RowsHandle, StaleSlotError
from forge.weight_transports import resolve_transport

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
            receiver.receive(PartsHandle.whole(handle), into)
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


def test_row_pieces_of_two_publishers_make_the_whole_version_and_its_checksum():
    """Two ranks of a sharded trainer each publish their rows (the norm is the first rank's
    alone); the reader puts each piece in its rows; the pieces' checksums sum to the whole's;
    pieces that leave a gap or overlap are refused."""
    whole = weights(3.0)
    ranks = [
        (
            {"embed.weight": whole["embed.weight"][:12], "norm.weight": whole["norm.weight"]},
            {"embed.weight": 0, "norm.weight": 0},
        ),
        ({"embed.weight": whole["embed.weight"][12:]}, {"embed.weight": 12}),
    ]
    parts = tuple(RowsHandle(IpcPublisher("cpu").publish(5, tensors), rows) for tensors, rows in ranks)
    into = {name: torch.zeros_like(t) for name, t in whole.items()}
    assert IpcReceiver().receive(PartsHandle(5, parts), into) == sum(
        t.numel() * t.element_size() for t in whole.values()
    )
    assert all(torch.equal(into[name], whole[name]) for name in whole)
    assert sum(checksum(tensors, first_rows=rows) for tensors, rows in ranks) == checksum(whole)
    gap = RowsHandle(parts[1].handle, {"embed.weight": 13})
    with pytest.raises(ValueError, match=r"'embed.weight': the published pieces \[\(0, 12\), \(13, 21\)\]"):
        IpcReceiver().receive(PartsHandle(5, (parts[0], gap)), into)
    with pytest.raises(KeyError, match="missing from it"):
        IpcReceiver().receive(PartsHandle(5, parts[1:]), into)
