"""Scoring responses with weighted reward functions, with a time limit on every call.

A reward function is user code: it may raise, return something that is not a finite number
(None, a string, ``inf``), never return, end its process (``os._exit``, a crash in C code) or
print megabytes. None of these may stop a run. A call that does not return a finite number
scores ``error_reward`` and is counted in ``reward/<name>/errors``; a call that runs longer
than ``timeout_s`` scores ``error_reward`` and is counted in ``reward/<name>/timeouts``.

A hung call cannot be interrupted inside the process that runs it (Python cannot kill a
thread, and C code may ignore signals), but a child process can be killed. So with a
``timeout_s`` the functions run in a worker process (``forge.data.reward_worker``), which
imports them once and runs each batch of calls in processes forked from it: one for the
whole batch, in order, while nothing fails; after a call fails, one per remaining call, all
at once, so that the batch's hung calls time out together (a batch takes about two
``timeout_s`` at most, not one per hung call; see `forge.data.reward_worker.run_batch`).
Calls run at once share the machine's cores: a reward function that needs seconds of CPU per call
wants a ``timeout_s`` well above that. Only plain data comes back from the worker.
The worker exits when its pipe from this process closes: at `close`, or when this process
dies however it dies; its forked processes die with it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from multiprocessing.connection import Connection

from forge.data.reward_worker import ERROR, TIMEOUT, Call, Outcome, call_here
from forge.data.rewards import get_reward_fn
from forge.observability import Reduce, record_metric

logger = logging.getLogger(__name__)

# How long a fresh worker may take to import the reward functions' modules (not a call).
WORKER_START_TIMEOUT_S = 300.0
COUNTERS = {ERROR: "errors", TIMEOUT: "timeouts"}


class RewardWorker:
    """The worker process: started on first use, and again after it was lost."""

    def __init__(self, names: list[str], timeout_s: float):
        self.names = names
        self.timeout_s = timeout_s
        self._process: subprocess.Popen | None = None
        self._send: Connection | None = None
        self._receive: Connection | None = None

    def _start(self) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        # The child resolves import paths exactly as this process does.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._process = subprocess.Popen(
            # -u: what a reward function prints is written at once, not lost with its process.
            [sys.executable, "-u", "-m", "forge.data.reward_worker", str(to_child_r), str(from_child_w)],
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
        self._send.send((self.names, self.timeout_s))
        if not self._receive.poll(WORKER_START_TIMEOUT_S):
            self.close()
            raise RuntimeError(f"the reward worker did not start within {WORKER_START_TIMEOUT_S:.0f} s")
        ready = self._receive.recv()
        if ready != "ready":  # a function could not be imported there
            self.close()
            raise RuntimeError(f"the reward worker could not load the reward functions: {ready[1]}")

    def run(self, calls: list[Call]) -> list[Outcome]:
        """The outcome of each call, in order (the worker always answers, or dies)."""
        if self._process is None:
            self._start()
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


class RewardScorer:
    """Scores responses with weighted reward functions (see the module docstring).

    ``timeout_s=None`` runs the functions in this process, with no time limit.
    """

    def __init__(
        self, functions: list[tuple[str, float]], error_reward: float = 0.0, timeout_s: float | None = None
    ):
        self.functions = [(name, weight, get_reward_fn(name)) for name, weight in functions]
        self.error_reward = error_reward
        # Since the start, for messages that explain a run's state (e.g. a starving trainer).
        self.counts = {"errors": 0, "timeouts": 0}
        self._worker = RewardWorker([name for name, _ in functions], timeout_s) if timeout_s else None

    def score(self, prompt: str, response: str, target: str) -> tuple[float, dict[str, float]]:
        """(weighted total, {function name: its value})."""
        return self.score_many([(prompt, response, target)])[0]

    def score_many(self, items: list[tuple[str, str, str]]) -> list[tuple[float, dict[str, float]]]:
        """`score` of each (prompt, response, target), in one batch of calls to the worker."""
        calls = [(i, *item) for item in items for i in range(len(self.functions))]
        if self._worker is not None:
            outcomes = self._worker.run(calls)
        else:
            outcomes = [call_here(self.functions[i][2], p, r, t) for i, p, r, t in calls]
        scores, per_item = [], len(self.functions)
        for start, (_, response, _) in zip(range(0, len(calls), per_item), items, strict=True):
            total, breakdown = 0.0, {}
            for (name, weight, _), outcome in zip(
                self.functions, outcomes[start : start + per_item], strict=True
            ):
                value = self._value(name, outcome, response)
                breakdown[name] = value
                record_metric(f"reward/{name}", value, Reduce.MEAN)
                total += weight * value
            record_metric("reward/total", total, Reduce.MEAN)
            scores.append((total, breakdown))
        return scores

    def _value(self, name: str, outcome: Outcome, response: str) -> float:
        if not isinstance(outcome, tuple):
            return outcome
        kind, why = outcome
        logger.warning(
            "reward function '%s' %s on response %r: scored %s", name, why, response[:200], self.error_reward
        )
        record_metric(f"reward/{name}/{COUNTERS[kind]}", 1, Reduce.SUM)
        self.counts[COUNTERS[kind]] += 1
        return self.error_reward

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
