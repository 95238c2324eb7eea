"""Liveness of actors that hang while alive: a deadline on each call, and death for a miss.

A process can stop answering without dying: an engine stuck in a kernel or a lock, a process
stopped by a signal, C code holding the GIL. Monarch's supervision sees deaths only, so such a
replica would hold its calls forever. forge bounds the calls whose time it can predict
(generation: `CallDeadline`, a base plus a time per token the call may sample) and turns a miss
into a death: the actor's processes are killed (SIGKILL, which a stuck process cannot refuse),
so that what follows is what follows any death (`route_within`, forge.controller.service). For
a replica of a service that is the replacement and a retry elsewhere; for a lone actor,
`ActorHungError`, which stops the run. A service also probes its idle replicas (`Probe`): a
replica that hangs between calls is found before a call waits on it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket

from pydantic import Field

from forge.config import ForgeConfigModel

logger = logging.getLogger(__name__)


class ActorHungError(RuntimeError):
    """An actor that nothing replaces did not answer a call within its deadline (its processes
    were killed)."""


class CallDeadline(ForgeConfigModel):
    # A call may take base_s, plus per_token_s for each token it may sample (prompts x n x
    # max_tokens). base_s also covers waiting for a newer policy inside the call (the trainer's
    # step, in sync mode) and a replica's first call.
    base_s: float = Field(600.0, gt=0)
    per_token_s: float = Field(0.005, ge=0)

    def seconds(self, tokens: int) -> float:
        return self.base_s + self.per_token_s * tokens


class Probe(ForgeConfigModel):
    # An idle replica (no call in flight) is asked for its process every every_s seconds and
    # must answer within timeout_s; a busy one is watched by its calls' deadlines.
    every_s: float = Field(10.0, gt=0)
    timeout_s: float = Field(60.0, gt=0)


def kill_processes(processes: list[tuple[str, int]], name: str) -> None:
    """SIGKILLs the (host name, pid) processes that run on this host; a worker host's cannot
    be signalled from here, and only their mesh's stop (or the worker) ends them."""
    here = socket.gethostname()
    for host, pid in processes:
        if host != here:
            logger.warning("%s: cannot kill pid %d on host %s from here", name, pid, host)
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it died meanwhile
