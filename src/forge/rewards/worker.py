"""The reward worker process (see `forge.rewards.scorer`), and `RewardWorker`, its handle in
the process that scores.

    python -u -m forge.rewards.worker READ_FD WRITE_FD

It receives (reward function names, timeout_s, memory_limit_bytes), imports the functions and answers "ready"
(or ``("error", why)``); then for each list of calls it receives, it sends back the list of
their outcomes. It never runs a reward function itself: it forks runners that do (a fork is
cheap and has the functions imported already), so whatever a call does (hang, end its
process, flood its output) costs only its runner, and the worker always answers. It exits
when its pipe from the parent closes, which is when the parent closes it or dies; runners
die with it.

A call of a group reward function (`forge.rewards.group_functions`) scores a whole group: its
prompt, response and target are the group's lists, and its outcome is a list of floats, one
per response. Outcomes are plain data (a float, a list of floats, or a (kind, why) pair of
strings): this module runs as the script ``__main__``, and an instance of a class defined here
would not unpickle in the parent.

A runner may map at most ``memory_limit_bytes`` beyond what it had when it was forked (the
worker's own address space: the interpreter and the imported functions' modules), as its
RLIMIT_AS (Linux). The limit counts from there rather than from zero because what imports map
is no call's doing and varies widely: measured on a 2-core CPU machine, a worker with the
built-in functions maps 28 MiB, 69 MiB with math-verify, 180 MiB with numpy (OpenBLAS reserves
buffers per core, so more on a large machine) and 665 MiB with torch (more with CUDA libraries).
An allocation past it raises MemoryError in the call, which fails, and the runner goes on with
the next call (what the failed allocation would have mapped was never mapped); C code that
cannot report it may end the runner instead, and the calls after it run in fresh runners.
"""

from __future__ import annotations

import ctypes
import math
import os
import resource
import signal
import subprocess
import sys
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection, wait

from forge.rewards.functions import RewardFn, get_reward_fn
from forge.rewards.group_functions import GroupRewardFn, is_group_reward

# (function index, prompt, response, target); for a group function, the group's lists of each.
Call = tuple[int, str, str, str] | tuple[int, list[str], list[str], list[str]]
ERROR, TIMEOUT = "error", "timeout"
# The value (a group function's: one per response), or (ERROR or TIMEOUT, why, for the log).
Outcome = float | list[float] | tuple[str, str]

# Runners alive at once: the batch's hung calls beyond this many wait for a free one.
MAX_RUNNERS = 64
# Error texts are cut to this length: they are for the log, and a short message reaches the
# worker in one atomic pipe write.
MESSAGE_CHARS = 500
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


class NotScores(Exception):
    """A reward function returned something other than its scores (the message says what)."""


def call_here(fn: RewardFn | GroupRewardFn, prompt, response, target) -> Outcome:
    """One call in this process: a finite number (a group function's: one per response, see
    `Call`); anything else becomes an `ERROR` outcome."""
    try:
        value = fn(prompt, response, target)
        return group_scores(value, len(response)) if is_group_reward(fn) else score(value)
    except NotScores as e:
        return ERROR, f"returned {e}"[:MESSAGE_CHARS]
    except (Exception, SystemExit) as e:  # sys.exit() in a reward function is its bug too
        # format_exception_only survives an exception whose str() raises.
        why = f"raised {''.join(traceback.format_exception_only(e)).strip()}"
        if isinstance(e, MemoryError):
            why += " (past reward.memory_limit_gib, or the machine's memory)"
        return ERROR, why[:MESSAGE_CHARS]


def score(value) -> float:
    # Not float(value) alone: it would parse a string such as "0.5". Numbers (int, float,
    # numpy and torch scalars, ...) define __float__.
    if not hasattr(type(value), "__float__"):
        raise NotScores(f"{type(value).__name__}, not a number")
    number = float(value)
    if not math.isfinite(number):
        raise NotScores(str(number))
    return number


def group_scores(values, size: int) -> list[float]:
    """A group function's scores: any sized sequence of numbers (list, tuple, numpy or torch
    vector), one per response of its group of `size`."""
    if isinstance(values, (str, bytes, dict)) or not all(
        hasattr(type(values), method) for method in ("__len__", "__iter__")
    ):
        raise NotScores(f"{type(values).__name__}, not a list of numbers")
    if len(values) != size:
        raise NotScores(f"{len(values)} scores for a group of {size} responses")
    scores = []
    for position, value in enumerate(values):
        try:
            scores.append(score(value))
        except NotScores as e:
            raise NotScores(f"{e}, at position {position}") from None
    return scores


class Runner:
    """A forked child that runs some of a batch's calls in order and sends each outcome as soon
    as the call returns; each call may take `timeout_s` from the previous one's answer, and the
    runner may map `memory_limit_bytes` (None: no limit) beyond the worker's address space."""

    def __init__(
        self,
        functions: list[RewardFn],
        calls: list[Call],
        indices: list[int],
        timeout_s: float,
        memory_limit_bytes: int | None,
    ):
        self.indices = indices  # positions in the batch, in the order the runner calls them
        self.answered = 0
        self.deadline = time.monotonic() + timeout_s
        read_fd, write_fd = os.pipe()
        worker = os.getpid()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.close(read_fd)
                die_with_parent(worker)
                if memory_limit_bytes is not None:
                    limit_address_space(memory_limit_bytes)
                send = Connection(write_fd, readable=False)
                for i in indices:
                    index, prompt, response, target = calls[i]
                    send.send(call_here(functions[index], prompt, response, target))
            finally:
                os._exit(0)  # never back into the worker's code
        os.close(write_fd)
        self.receive = Connection(read_fd, writable=False)

    @property
    def current(self) -> int:
        """The batch position of the call the runner is on."""
        return self.indices[self.answered]

    def stop(self) -> int:
        """Kills the runner (if it is still running) and returns its exit code (-N: signal N)."""
        os.kill(self.pid, signal.SIGKILL)  # a runner that has exited is a zombie until reaped
        _, status = os.waitpid(self.pid, 0)
        self.receive.close()
        return os.waitstatus_to_exitcode(status)


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies, even while it is stuck in C code (Linux)."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before prctl
        os._exit(1)


def limit_address_space(growth_bytes: int) -> None:
    """Limits this process's address space to what it maps now plus `growth_bytes` (Linux: where
    /proc is; RLIMIT_AS is not enforced on macOS)."""
    if sys.platform != "linux":
        return
    with open("/proc/self/statm") as f:  # its first field: the address space's size, in pages
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + growth_bytes, mapped + growth_bytes))


def run_batch(
    functions: list[RewardFn],
    calls: list[Call],
    timeout_s: float,
    memory_limit_bytes: int | None,
    parent: Connection,
) -> list[Outcome] | None:
    """The outcome of each call, or None if the parent died meanwhile.

    One runner runs all the calls in order (the common case costs one fork per batch). When
    a call fails (times out or ends its runner), the calls after it each get a runner of
    their own, all started at once: the hung ones among them time out together, so a batch
    takes about two `timeout_s` at most rather than one per hung call (one more for each
    `MAX_RUNNERS` hung calls beyond the first).
    """
    outcomes: list[Outcome | None] = [None] * len(calls)
    waiting = deque([list(range(len(calls)))])
    runners: dict[Connection, Runner] = {}
    while waiting or runners:
        while waiting and len(runners) < MAX_RUNNERS:
            runner = Runner(functions, calls, waiting.popleft(), timeout_s, memory_limit_bytes)
            runners[runner.receive] = runner
        next_deadline = min(r.deadline for r in runners.values())
        ready = wait([parent, *runners], timeout=max(0.0, next_deadline - time.monotonic()))
        if parent in ready:  # the parent sends nothing during a batch: its end closed
            return None
        now = time.monotonic()
        for runner in list(runners.values()):
            if runner.receive in ready:
                try:
                    outcomes[runner.current] = runner.receive.recv()
                except EOFError:  # the call ended its process (os._exit, a crash in C code)
                    code = runner.stop()
                    how = f"exit code {code}" if code >= 0 else f"signal {-code}"
                    failed = ERROR, f"ended its process ({how})"
                else:
                    runner.answered += 1
                    runner.deadline = now + timeout_s
                    if runner.answered == len(runner.indices):
                        runner.stop()
                        del runners[runner.receive]
                    continue
            elif now >= runner.deadline:
                runner.stop()
                failed = TIMEOUT, f"timed out after {timeout_s:g} s"
            else:
                continue
            outcomes[runner.current] = failed
            del runners[runner.receive]
            waiting.extend([i] for i in runner.indices[runner.answered + 1 :])
    return outcomes


def serve(receive: Connection, send: Connection) -> None:
    # Ctrl-C in a terminal reaches every process of the group; this one's parent stops it (and
    # a KeyboardInterrupt here would only print a traceback over the app's own message).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    names, timeout_s, memory_limit_bytes = receive.recv()
    try:
        functions = [get_reward_fn(name) for name in names]
    except ValueError as e:
        send.send((ERROR, str(e)))
        return
    send.send("ready")
    while True:
        try:
            calls = receive.recv()
        except EOFError:  # the parent closed the pipe or died
            return
        outcomes = run_batch(functions, calls, timeout_s, memory_limit_bytes, receive)
        if outcomes is None:
            return
        send.send(outcomes)


# How long a fresh worker may take to import the reward functions' modules (not a call).
WORKER_START_TIMEOUT_S = 300.0


class RewardWorker:
    """The worker process: started on first use, and again after it was lost."""

    def __init__(self, names: list[str], timeout_s: float, memory_limit_gib: float | None = None):
        self.names = names
        self.timeout_s = timeout_s
        self.memory_limit_bytes = None if memory_limit_gib is None else int(memory_limit_gib * 2**30)
        self._process: subprocess.Popen | None = None
        self._send: Connection | None = None
        self._receive: Connection | None = None

    def start(self) -> None:
        """Starts the process, unless it runs."""
        if self._process is not None:
            return
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        # The child resolves import paths exactly as this process does.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._process = subprocess.Popen(
            # -u: what a reward function prints is written at once, not lost with its process.
            [sys.executable, "-u", "-m", "forge.rewards.worker", str(to_child_r), str(from_child_w)],
            pass_fds=(to_child_r, from_child_w),
            stdin=subprocess.DEVNULL,  # a reward function reading input fails rather than waits
            env=env,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._send, self._receive = (
            Connection(to_child_w, readable=False),
            Connection(from_child_r, writable=False),
        )
        self._send.send((self.names, self.timeout_s, self.memory_limit_bytes))
        if not self._receive.poll(WORKER_START_TIMEOUT_S):
            self.close()
            raise RuntimeError(f"the reward worker did not start within {WORKER_START_TIMEOUT_S:.0f} s")
        ready = self._receive.recv()
        if ready != "ready":  # a function could not be imported there
            self.close()
            raise RuntimeError(f"the reward worker could not load the reward functions: {ready[1]}")

    def run(self, calls: list[Call]) -> list[Outcome]:
        """The outcome of each call, in order (the worker always answers, or dies)."""
        self.start()
        try:
            self._send.send(calls)
            return self._receive.recv()
        except (EOFError, OSError):
            # Not a reward function's doing (none runs in the worker): it was killed from
            # outside (the OOM killer, a signal). Its batch is lost; the next starts a new one.
            code = self.close()
            return [(ERROR, f"was lost with the reward worker (exit code {code})")] * len(calls)

    def close(self) -> int | None:
        """Kills the worker (its forked processes die with it); returns its exit code."""
        if self._process is None:
            return None
        self._process.kill()
        code = self._process.wait()
        self._send.close()
        self._receive.close()
        self._process = self._send = self._receive = None
        return code


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
