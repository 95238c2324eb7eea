"""The broadcast weight transport (forge.store.broadcast) between processes: trainer ranks that
each send their rows of a version, generator replicas that receive every rank's rows, on GPUs
over NCCL (each process its own GPU) or on CPU over gloo. Prints a table.

    PYTHONPATH=src:. python bench/broadcast_check.py [--senders 2] [--receivers 2] [--gb 3.4]
        [--versions 5] [--timeout-s 20]

Each version is `--gb` GB of bf16 rows (3.4 GB: Qwen3-1.7B), every tensor split by rows over
the senders as FSDP shards it, its values a function of the version, so a receiver checks every
byte of what it assembled. After the timed versions one receiver is SIGKILLed and a version
published: its transfer to the epoch that holds the dead receiver fails or times out, and the
others must still get that version (from a new epoch without the dead one); a replacement for
the dead replica must then get the newest version without another publish. Ready ms: from the senders' publish to a receiver holding the whole version.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import socket
import statistics
import time

import torch

ROWS = 4096  # each tensor is [ROWS, width] bf16


def device_for(index: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(index % torch.cuda.device_count())
        return torch.device("cuda", index % torch.cuda.device_count())
    return torch.device("cpu")


def weights(version: int, gb: float, device: torch.device) -> dict[str, torch.Tensor]:
    """`gb` GB of bf16 in tensors of ROWS rows; element i of tensor k is a function of (v, k, i)."""
    count = max(1, round(gb * 1e9 / (ROWS * 8192 * 2)))
    out = {}
    for k in range(count):
        base = torch.arange(ROWS * 8192, device=device, dtype=torch.float32) % 251
        out[f"layer{k}.weight"] = ((base + version * 7 + k) % 253).to(torch.bfloat16).reshape(ROWS, 8192)
    return out


def rows(tensors: dict[str, torch.Tensor], rank: int, ranks: int):
    share = -(-ROWS // ranks)
    first = rank * share
    return {n: t[first : first + share] for n, t in tensors.items()}, dict.fromkeys(tensors, first)


def sender(rank: int, ranks: int, port: int, args, commands, done) -> None:
    from forge.store.broadcast import BroadcastSender, Rendezvous

    device = device_for(rank)
    rendezvous = Rendezvous("127.0.0.1", port, serve=rank == 0, timeout_s=args.timeout_s)
    end = BroadcastSender(rendezvous, rank, device, timeout_s=args.timeout_s, join_s=5.0)
    while (version := commands.get()) is not None:
        end.stage(version, *rows(weights(version, args.gb, device), rank, ranks))
        if rank == 0:
            end.announce(version, senders=ranks)
        done.put((rank, version))
    end.stop()


def receiver(replica: int, index: int, port: int, args, results) -> None:
    from forge.store.broadcast import BroadcastReceiver, Rendezvous

    device = device_for(index)
    end = BroadcastReceiver(
        Rendezvous("127.0.0.1", port, serve=False, timeout_s=args.timeout_s), replica, device, args.timeout_s
    )
    into, seen = None, None
    while True:
        end.check()
        version = end.version
        if version is None or version == seen:
            time.sleep(0.001)
            continue
        ready = time.time()
        expected = weights(version, args.gb, device)
        into = into or {n: torch.empty_like(t) for n, t in expected.items()}
        try:
            published = end.copy_into(version, into)
        except LookupError:
            continue
        exact = all(torch.equal(into[n], expected[n]) for n in expected)
        results.put((replica, os.getpid(), version, (ready - published) * 1e3, exact))
        seen = version


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--senders", type=int, default=2)
    parser.add_argument("--receivers", type=int, default=2)
    parser.add_argument("--gb", type=float, default=3.4)
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=20.0)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    port = free_port()
    commands = [ctx.Queue() for _ in range(args.senders)]
    done, results = ctx.Queue(), ctx.Queue()
    senders = [
        ctx.Process(target=sender, args=(r, args.senders, port, args, commands[r], done))
        for r in range(args.senders)
    ]
    for p in senders:
        p.start()
    time.sleep(2.0)  # the first sender serves the rendezvous
    receivers = {
        r: ctx.Process(target=receiver, args=(r, args.senders + r, port, args, results), daemon=True)
        for r in range(args.receivers)
    }
    for p in receivers.values():
        p.start()

    def publish(version: int) -> float:
        started = time.perf_counter()
        for queue in commands:
            queue.put(version)
        for _ in commands:
            done.get(timeout=120)
        return time.perf_counter() - started

    def collect(version: int, replicas: set[int], timeout_s: float) -> dict[int, tuple]:
        got, deadline = {}, time.monotonic() + timeout_s
        while set(got) != replicas and time.monotonic() < deadline:
            try:
                replica, pid, v, ready_ms, exact = results.get(timeout=max(deadline - time.monotonic(), 0.01))
            except Exception:
                break
            if v == version:
                got[replica] = (pid, ready_ms, exact)
        return got

    rows_out = []
    everyone = set(receivers)
    for version in range(1, args.versions + 1):
        stage_s = publish(version)
        got = collect(version, everyone, 120)
        rows_out.append((f"version {version}", stage_s, got))

    # A receiver SIGKILLed, then a version published: its transfer to the epoch that still
    # holds the dead one fails (or times out), and the rest get it from a new epoch.
    dead = args.receivers - 1
    version = args.versions + 1
    os.kill(receivers[dead].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    publish(version)
    survivors = everyone - {dead}
    got = collect(version, survivors, 3 * args.timeout_s + 60)
    rows_out.append(
        (f"version {version}, replica {dead} SIGKILLed before it", time.monotonic() - killed_at, got)
    )
    replacement = ctx.Process(
        target=receiver, args=(dead, args.senders + dead, port, args, results), daemon=True
    )
    replacement.start()
    started = time.monotonic()
    got = collect(version, {dead}, 3 * args.timeout_s + 60)
    rows_out.append(
        (f"version {version} to replica {dead}'s replacement, no publish", time.monotonic() - started, got)
    )

    gb = sum(t.numel() * 2 for t in weights(0, args.gb, torch.device("meta")).values()) / 1e9
    device = (
        f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, NCCL"
        if torch.cuda.is_available()
        else "CPU, gloo"
    )
    print(
        f"broadcast: {args.senders} senders, {args.receivers} receivers, {gb:.2f} GB a version, {device}, torch {torch.__version__}"
    )
    print("| event | s | ready ms by replica | every byte exact |")
    print("|---|---:|---|---|")
    for name, seconds, got in rows_out:
        ready = " / ".join(f"{r}: {got[r][1]:.0f}" if r in got else f"{r}: -" for r in sorted(everyone))
        exact = all(g[2] for g in got.values()) and bool(got)
        print(f"| {name} | {seconds:.2f} | {ready} | {exact} |")
    steady = [g[1] for _, _, got in rows_out[1 : args.versions] for g in got.values()]
    if steady:
        print(
            f"ready ms, versions 2-{args.versions}: median {statistics.median(steady):.0f}, "
            f"{gb / (statistics.median(steady) / 1e3):.1f} GB/s a replica"
        )
    for p in [*receivers.values(), replacement]:  # first: without the senders they fail
        p.kill()
    for queue in commands:
        queue.put(None)
    for p in senders:
        p.join(timeout=60)


if __name__ == "__main__":
    main()
