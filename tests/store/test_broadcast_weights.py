"""The broadcast transport's two ends in one process (gloo groups between threads): two
trainer ranks each send their rows, two replicas assemble the whole version; a replica that
dies is left out of the next epoch, and its replacement receives the newest version at once."""

import time

import pytest
import torch

from forge.store.broadcast import BroadcastReceiver, BroadcastSender, Rendezvous

WEIGHTS = {"embed": torch.arange(40.0).reshape(10, 4), "norm": torch.arange(4.0), "scale": torch.tensor(2.0)}


def rows(weights: dict[str, torch.Tensor], rank: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Rank `rank` of two: the first or second half of each tensor's rows (a scalar on rank 0)."""
    tensors, first_rows = {}, {}
    for name, tensor in weights.items():
        if tensor.dim() == 0:
            if rank == 0:
                tensors[name], first_rows[name] = tensor, 0
            continue
        half = -(-tensor.shape[0] // 2)
        start = 0 if rank == 0 else half
        tensors[name], first_rows[name] = tensor[start : start + half] if rank == 0 else tensor[half:], start
    return tensors, first_rows


def wait_for(receiver: BroadcastReceiver, version: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while receiver.version != version:
        assert time.monotonic() < deadline, (
            f"replica {receiver.replica} holds {receiver.version}, not {version}"
        )
        time.sleep(0.01)


def received(receiver: BroadcastReceiver, version: int) -> dict[str, torch.Tensor]:
    into = {name: torch.full_like(t, -1.0) for name, t in WEIGHTS.items()}
    receiver.copy_into(version, into)
    return into


def publish(senders: list[BroadcastSender], version: int, weights: dict[str, torch.Tensor]) -> None:
    for rank, sender in enumerate(senders):
        sender.stage(version, *rows(weights, rank))
    senders[0].announce(version, senders=len(senders))


@pytest.fixture
def rendezvous():
    host = Rendezvous("127.0.0.1", 0, serve=True, timeout_s=5.0)
    yield host
    del host


def test_two_ranks_rows_reach_two_replicas_and_a_replacement_gets_the_newest_at_once(rendezvous):
    address = rendezvous.address

    def join(serve=False) -> Rendezvous:
        return Rendezvous(*address, serve=serve, timeout_s=5.0)

    cpu = torch.device("cpu")
    senders = [
        BroadcastSender(rendezvous, 0, cpu, timeout_s=5.0, join_s=2.0),
        BroadcastSender(join(), 1, cpu, 5.0),
    ]
    replicas = [BroadcastReceiver(join(), r, cpu, timeout_s=5.0) for r in range(2)]
    try:
        publish(senders, 1, WEIGHTS)
        for replica in replicas:
            wait_for(replica, 1)
            got = received(replica, 1)
            assert all(torch.equal(got[name], WEIGHTS[name]) for name in WEIGHTS)
            assert replica.published_at is not None and replica.published_at <= time.time()

        # Replica 1 dies: version 2's transfer fails or times out, the next epoch leaves it out.
        replicas[1].stop()
        second = {name: t + 100 for name, t in WEIGHTS.items()}
        publish(senders, 2, second)
        wait_for(replicas[0], 2)
        assert torch.equal(received(replicas[0], 2)["embed"], second["embed"])
        assert rendezvous.get("epoch/0/failed") and rendezvous.get("epoch/1/members") == [replicas[0].token]
        with pytest.raises(LookupError):  # the buffers hold version 2 now
            replicas[0].copy_into(1, {name: torch.empty_like(t) for name, t in WEIGHTS.items()})

        # Its replacement (the same replica index) gets version 2 without another publish.
        replicas[1] = BroadcastReceiver(join(), 1, cpu, timeout_s=5.0)
        wait_for(replicas[1], 2)
        assert all(torch.equal(received(replicas[1], 2)[name], second[name]) for name in WEIGHTS)

        # A version published whole by the first rank alone reaches both.
        senders[0].stage(3, WEIGHTS, dict.fromkeys(WEIGHTS, 0))
        senders[0].announce(3, senders=1)
        for replica in replicas:
            wait_for(replica, 3)
            assert torch.equal(received(replica, 3)["norm"], WEIGHTS["norm"])
    finally:
        for end in [*replicas, *senders]:
            end.stop()
