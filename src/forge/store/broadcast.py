"""Weights from the trainer to generators that cannot map its memory (another host): every
trainer rank broadcasts its own rows of a version to every generator replica over a collective
group of its own (NCCL on GPUs, gloo on CPU), so nothing is gathered on one rank and all
replicas receive at once. On one host CUDA IPC (`forge.store.cuda_ipc`) needs no copy at all.

A collective with a dead member never completes, and replicas die and are replaced during a
run, so the groups are formed in epochs, through a TCPStore that the first trainer rank
serves (`Rendezvous`; its address travels in forge's store):

- a receiver registers under its replica index with a fresh token (a replacement's
  registration supersedes the dead replica's);
- the first rank forms an epoch when the registrations changed or the last epoch failed: it
  proposes the registered tokens, waits up to `join_s` for each to acknowledge, and makes
  those that did the epoch's members (a dead replica never does; a live one that missed the
  window registers again, which forms another epoch);
- it announces transfers in order, each (epoch, version, senders): every sender and every
  member of that epoch takes part. A new epoch starts with the newest version again, so a
  replacement replica receives the policy being trained without waiting for the next step;
- a transfer that fails or outlasts `timeout_s` anywhere marks its epoch failed: its groups
  are aborted on every member, and the next transfer goes to a new epoch without the dead.

A sender stages its rows in one buffer, and staging the next version waits for a send in
progress. A receiver keeps the newest complete version in one buffer per sender (the generator
copies from them between requests, as from an IPC slot): one more copy of the weights on the
generator's device. A transfer whose parts are not all of one version (a sender restaged
meanwhile) is dropped; the next transfer replaces it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
import time
import uuid

import torch
import torch.distributed as dist

from forge.cuda_threads import make_current
from forge.store.cuda_ipc import FlatLayout, TensorSpec, check_tiles, rows_of

_POLL_S = 0.01
_HEADER = 4  # int64s: version, layout bytes, payload bytes, publish time (microseconds)


class TransferFailed(RuntimeError):
    """A member failed, left or outlasted the timeout during a transfer; its epoch is over."""


def _layout_bytes(layout: FlatLayout, first_rows: dict[str, int]) -> bytes:
    """A sender's part as JSON: its layout, the first row of each piece, and its host (a publish
    time is comparable with a receiver's clock on the same host only)."""
    specs = [[s.name, list(s.shape), str(s.dtype).removeprefix("torch."), s.offset] for s in layout.specs]
    fields = {"nbytes": layout.nbytes, "specs": specs, "first_rows": first_rows, "host": socket.gethostname()}
    return json.dumps(fields).encode()


def _layout_from(data: bytes) -> tuple[FlatLayout, dict[str, int], str]:
    fields = json.loads(data)
    specs = tuple(
        TensorSpec(name, tuple(shape), getattr(torch, dtype), offset)
        for name, shape, dtype, offset in fields["specs"]
    )
    return FlatLayout(specs, fields["nbytes"]), fields["first_rows"], fields["host"]


@contextlib.contextmanager
def _environment(**values: str):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def this_host() -> str:
    """An address of this host that other hosts can reach (the TCPStore listens on all)."""
    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return "127.0.0.1"


class Rendezvous:
    """JSON values in the TCPStore that every sender and receiver of one trainer shares."""

    def __init__(self, host: str, port: int, serve: bool, timeout_s: float) -> None:
        self.store = dist.TCPStore(
            host,
            port,
            is_master=serve,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.timeout_s = timeout_s

    @property
    def address(self) -> tuple[str, int]:
        return self.store.host, self.store.port

    def set(self, key: str, value: object) -> None:
        self.store.set(key, json.dumps(value))

    def get(self, key: str, default: object = None) -> object:
        if not self.store.check([key]):
            return default
        return json.loads(self.store.get(key))

    def count(self, key: str, add: int = 0) -> int:
        return self.store.add(key, add)

    def group(self, epoch: int, sender: int, rank: int, size: int, device: torch.device):
        """Sender `sender`'s group in `epoch` (the sender is rank 0 of it). gloo's connections
        wait `timeout_s` for every member; NCCL's own timeout is past it, so that a stuck
        collective is aborted by us (`_Groups.broadcast`) before its watchdog acts."""
        prefixed = dist.PrefixStore(f"epoch{epoch}/sender{sender}/", self.store)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = datetime.timedelta(seconds=self.timeout_s + 60)
            # A dead member must fail the transfer, not this process: by default torch's
            # watchdog ends a process whose NCCL group saw an error. A group reads the setting
            # when it is made, so the trainer's own (FSDP) groups keep the default.
            with _environment(TORCH_NCCL_ASYNC_ERROR_HANDLING="0"):
                return dist.ProcessGroupNCCL(prefixed, rank, size, options)
        return dist.ProcessGroupGloo(prefixed, rank, size, datetime.timedelta(seconds=self.timeout_s))


class _Worker:
    """A daemon thread whose unexpected error (the rendezvous gone: the trainer died) is kept
    and raised to the next caller of `check`, instead of ending the thread silently."""

    def _start(self, name: str) -> None:
        self.error: BaseException | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._guarded, name=name, daemon=True)
        self._thread.start()

    def _guarded(self) -> None:
        try:
            make_current(self.device)
            self._run()
        except BaseException as e:
            if not self._stopped.is_set():
                self.error = e

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"weight broadcast: {self._thread.name} failed: {self.error}") from self.error

    def _run(self) -> None:
        raise NotImplementedError


class _Groups:
    """The groups of the current epoch, built on first use and aborted together."""

    def __init__(self, rendezvous: Rendezvous, device: torch.device) -> None:
        self.rendezvous = rendezvous
        self.device = device
        self.epoch: int | None = None
        self._groups: dict[int, object] = {}

    def get(self, epoch: int, sender: int, rank: int, size: int):
        if epoch != self.epoch:
            self.abort()
            self.epoch = epoch
        if sender not in self._groups:
            try:
                self._groups[sender] = self.rendezvous.group(epoch, sender, rank, size, self.device)
            except Exception as e:  # a member never connected (gloo connects here, NCCL later)
                raise TransferFailed(f"epoch {epoch}: {e}") from e
        return self._groups[sender]

    def abort(self) -> None:
        for group in self._groups.values():
            # A failed group's connections may be half gone; aborting frees what is left.
            with contextlib.suppress(Exception):
                group.abort()
        self._groups = {}
        self.epoch = None

    def broadcast(
        self, group, tensor: torch.Tensor, epoch: int, deadline: float, stopped: threading.Event
    ) -> None:
        """`tensor` from the group's rank 0 to all, or `TransferFailed` when a member fails,
        the epoch is marked failed, or `deadline` (monotonic) passes."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        work = group.broadcast([tensor], options)
        failed_key, next_check = f"epoch/{epoch}/failed", 0.0
        while not work.is_completed():
            now = time.monotonic()
            if now > deadline or stopped.is_set():
                raise TransferFailed(f"epoch {epoch}: a transfer outlasted its timeout")
            if now > next_check:
                if self.rendezvous.store.check([failed_key]):
                    raise TransferFailed(f"epoch {epoch} failed on another member")
                next_check = now + 0.05
            time.sleep(0.0005)
        try:
            work.wait()
        except Exception as e:  # a member's connection broke: the collective's own error
            raise TransferFailed(f"epoch {epoch}: {e}") from e


class BroadcastSender(_Worker):
    """One trainer rank: stages its rows, and sends them in every transfer that names it. The
    first rank (`coordinator`) also forms the epochs and announces the transfers."""

    def __init__(
        self,
        rendezvous: Rendezvous,
        rank: int,
        device: torch.device,
        timeout_s: float = 60.0,
        join_s: float = 10.0,
    ) -> None:
        self.rendezvous = rendezvous
        self.rank = rank
        self.device = device
        self.timeout_s = timeout_s
        self.join_s = join_s
        self._groups = _Groups(rendezvous, device)
        self._cond = threading.Condition()
        self._buffer: torch.Tensor | None = None
        self._layout: bytes = b""
        self._staged: tuple[int, float, int] | None = None  # version, publish time, bytes
        self._sending = False
        # The coordinator's state: registrations read, the epoch in use, the newest announced.
        self._registrations_read = 0
        self._tokens: dict[int, str] = {}
        self._epoch: int | None = None
        self._epochs = 0
        self._announced: tuple[int, int] | None = None  # version, senders
        self._transfers = 0
        self._start(f"broadcast-sender-{rank}")

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    def stage(
        self, version: int, tensors: dict[str, torch.Tensor], first_rows: dict[str, int], dtype=None
    ) -> int:
        """Copies this rank's rows of `version` into its buffer once no send is in progress, and
        returns their bytes. A version staged and not yet sent is replaced: it goes out newer."""
        self.check()
        layout = FlatLayout.of(tensors, dtype)
        with self._cond:
            while self._sending:
                self._cond.wait()
            if self._buffer is None or self._buffer.numel() < layout.nbytes:
                self._buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
            views = layout.views(self._buffer)
            for name, tensor in tensors.items():
                views[name].copy_(tensor, non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._layout = _layout_bytes(layout, first_rows)
            self._staged = (version, time.time(), layout.nbytes)
            self._cond.notify_all()
        return layout.nbytes

    def wait_sent(self) -> None:
        """Until no send is in progress (done or failed): `stage` then proceeds at once."""
        with self._cond:
            while self._sending:
                self._cond.wait()

    def announce(self, version: int, senders: int) -> None:
        """The coordinator: `version` is staged on `senders` ranks (1 when published whole)."""
        self.check()
        with self._cond:
            self._announced = (version, senders)
            self._cond.notify_all()

    def stop(self) -> None:
        self._stopped.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=self.timeout_s)
        self._groups.abort()

    def _run(self) -> None:
        sent = None  # the (version, senders) last announced to an epoch
        while not self._stopped.is_set():
            if self.coordinator:
                sent = self._coordinate(sent)
            transfer = self.rendezvous.get(f"transfer/{self._transfers}")
            if transfer is None:
                time.sleep(_POLL_S)
                continue
            self._transfers += 1
            if self.rank < transfer["senders"]:
                self._send(transfer)

    def _coordinate(self, sent):
        """Forms a new epoch when the registrations changed or the epoch failed, and announces
        the newest version to the epoch in use when it has not had it."""
        with self._cond:
            announced = self._announced
        if announced is None:
            return sent
        changed = self.rendezvous.count("registration_slots") != self._registrations_read
        failed = self._epoch is not None and self.rendezvous.get(f"epoch/{self._epoch}/failed")
        if changed or failed:
            self._form_epoch()
            sent = None
        if self._epoch is not None and announced != sent:
            version, senders = announced
            index = self.rendezvous.count("transfers")
            self.rendezvous.set(
                f"transfer/{index}", {"epoch": self._epoch, "version": version, "senders": senders}
            )
            self.rendezvous.count("transfers", 1)  # where a receiver that registers now starts
            sent = announced
        return sent

    def _form_epoch(self) -> None:
        # In order, up to one not written yet (its writer is between counting and writing).
        while (entry := self.rendezvous.get(f"registration/{self._registrations_read}")) is not None:
            self._tokens[entry["replica"]] = entry["token"]  # a replacement supersedes the dead
            self._registrations_read += 1
        candidates = list(self._tokens.values())
        epoch, self._epochs = self._epochs, self._epochs + 1
        self.rendezvous.set(f"epoch/{epoch}/candidates", candidates)
        self.rendezvous.set("proposal", epoch)
        deadline = time.monotonic() + self.join_s
        acked: list[str] = []
        while time.monotonic() < deadline and not self._stopped.is_set():
            acked = [t for t in candidates if self.rendezvous.store.check([f"epoch/{epoch}/ack/{t}"])]
            if len(acked) == len(candidates):
                break
            time.sleep(_POLL_S)
        self.rendezvous.set(f"epoch/{epoch}/members", acked)
        self._epoch = epoch if acked else None

    def _send(self, transfer: dict) -> None:
        epoch, version = transfer["epoch"], transfer["version"]
        members = self.rendezvous.get(f"epoch/{epoch}/members")
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            # This rank stages the version at about the time the first one announced it.
            while (self._staged is None or self._staged[0] < version) and not self._stopped.is_set():
                if not self._cond.wait(timeout=max(deadline - time.monotonic(), 0)):
                    break
            if self._staged is None:
                return
            self._sending = True
        try:
            staged_version, published_at, nbytes = self._staged
            layout = torch.frombuffer(bytearray(self._layout), dtype=torch.uint8).to(self.device)
            payload = self._buffer[:nbytes]
            header = torch.tensor(
                [staged_version, layout.numel(), payload.numel(), int(published_at * 1e6)],
                dtype=torch.int64,
                device=self.device,
            )
            group = self._groups.get(epoch, self.rank, 0, 1 + len(members))
            for tensor in (header, layout, payload):
                self._groups.broadcast(group, tensor, epoch, deadline, self._stopped)
        except TransferFailed:
            self.rendezvous.set(f"epoch/{epoch}/failed", True)
            self._groups.abort()
        finally:
            with self._cond:
                self._sending = False
                self._cond.notify_all()


class BroadcastReceiver(_Worker):
    """One generator replica: registers, joins the epochs it is proposed for, and keeps the
    newest version whose parts all arrived."""

    def __init__(
        self, rendezvous: Rendezvous, replica: int, device: torch.device, timeout_s: float = 60.0
    ) -> None:
        self.rendezvous = rendezvous
        self.replica = replica
        self.device = device
        self.timeout_s = timeout_s
        self.token = uuid.uuid4().hex
        self._groups = _Groups(rendezvous, device)
        self._lock = threading.Lock()  # held while the buffers are written or read
        self._buffers: list[torch.Tensor] = []
        self._layouts: list[tuple[FlatLayout, dict[str, int]]] = []
        self.version: int | None = None  # of the complete version in the buffers
        self.published_at: float | None = None
        self._acked = -1
        self._register()
        self._transfers = self.rendezvous.count("transfers")
        self._start(f"broadcast-receiver-{replica}")

    def _register(self) -> None:
        # Epochs proposed from now on know this registration; one that leaves this replica
        # out was late for it, and registering again asks for another.
        self._registered_before = self.rendezvous.get("proposal", -1)
        index = self.rendezvous.count("registration_slots", 1) - 1
        self.rendezvous.set(f"registration/{index}", {"replica": self.replica, "token": self.token})

    def stop(self) -> None:
        """Stops receiving; to the others this replica is dead, left out of the next epoch."""
        self._stopped.set()
        self._thread.join(timeout=self.timeout_s)
        self._groups.abort()

    def copy_into(self, version: int, into: dict[str, torch.Tensor]) -> float | None:
        """Copies `version` (each part into its rows of `into`); returns its publish time (None
        from another host, whose clock may differ), or raises LookupError when the buffers hold
        another version by now."""
        with self._lock:
            if self.version != version:
                raise LookupError(f"weight version {version} is no longer held (now: {self.version})")
            check_tiles([(layout, first_rows) for layout, first_rows, _ in self._layouts], into)
            for buffer, (layout, first_rows, _) in zip(self._buffers, self._layouts, strict=True):
                views = layout.views(buffer)
                for name, target in rows_of(layout, first_rows, into).items():
                    target.copy_(views[name])
            return self.published_at

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._acknowledge()
            transfer = self.rendezvous.get(f"transfer/{self._transfers}")
            if transfer is None:
                time.sleep(_POLL_S)
                continue
            self._transfers += 1
            members = self.rendezvous.get(f"epoch/{transfer['epoch']}/members")
            if self.token not in members:
                if transfer["epoch"] > self._registered_before:
                    self._register()
                continue
            try:
                self._receive(transfer, members)
            except TransferFailed:
                self.rendezvous.set(f"epoch/{transfer['epoch']}/failed", True)
                self._groups.abort()

    def _acknowledge(self) -> None:
        proposal = self.rendezvous.get("proposal")
        if proposal is not None and proposal > self._acked:
            self._acked = proposal
            if self.token in self.rendezvous.get(f"epoch/{proposal}/candidates", []):
                self.rendezvous.set(f"epoch/{proposal}/ack/{self.token}", True)

    def _receive(self, transfer: dict, members: list[str]) -> None:
        epoch = transfer["epoch"]
        rank, size = 1 + members.index(self.token), 1 + len(members)
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            self.version = None  # the buffers are being rewritten
            buffers, layouts, versions, published = [], [], set(), []
            for sender in range(transfer["senders"]):
                group = self._groups.get(epoch, sender, rank, size)
                header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
                self._groups.broadcast(group, header, epoch, deadline, self._stopped)
                version, layout_bytes, payload_bytes, published_us = header.tolist()
                layout = torch.empty(layout_bytes, dtype=torch.uint8, device=self.device)
                self._groups.broadcast(group, layout, epoch, deadline, self._stopped)
                buffer = self._buffer(sender, payload_bytes)
                self._groups.broadcast(group, buffer, epoch, deadline, self._stopped)
                buffers.append(buffer)
                layouts.append(_layout_from(layout.cpu().numpy().tobytes()))
                versions.add(version)
                published.append(published_us / 1e6)
            if len(versions) == 1:  # else a sender restaged meanwhile: the next transfer is whole
                self._buffers, self._layouts = buffers, layouts
                here = all(host == socket.gethostname() for _, _, host in layouts)
                self.version, self.published_at = versions.pop(), min(published) if here else None

    def _buffer(self, sender: int, nbytes: int) -> torch.Tensor:
        while len(self._buffers) <= sender:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self._buffers[sender].numel() != nbytes:
            self._buffers[sender] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffers[sender]
