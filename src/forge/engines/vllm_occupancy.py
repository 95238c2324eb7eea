"""How many samples vLLM runs at once, step by step: what shows whether a replica runs all the
samples it is given. Past what its KV cache holds (or ``max_num_seqs``), vLLM keeps samples
waiting, or preempts running ones and recomputes their caches later, so it runs fewer at once
than it was given (``forge.runs.placement.kv_cache_line`` says so before the run).

Read from the in-process engine core's scheduler (``EngineCore.scheduler.running``) after each
engine step, on the engine thread; taken by the generator from its own thread.
"""

from __future__ import annotations

import threading

from forge.engines.vllm_config import in_process_core


class RunningSamples:
    """The samples vLLM's scheduler runs after each step, since the last ``take``."""

    def __init__(self, llm):
        self._scheduler = getattr(in_process_core(llm), "scheduler", None)
        self._lock = threading.Lock()
        self._steps = self._total = self._most = 0

    def count(self) -> None:
        """After an engine step: how many samples the scheduler now runs."""
        if self._scheduler is None:
            return
        running = len(self._scheduler.running)
        with self._lock:
            self._steps += 1
            self._total += running
            self._most = max(self._most, running)

    def take(self) -> tuple[float, int] | None:
        """The mean and the most samples run at once per step since the last call; None when
        no step ran (or the engine core is in another process)."""
        with self._lock:
            if not self._steps:
                return None
            taken = (self._total / self._steps, self._most)
            self._steps = self._total = self._most = 0
        return taken
