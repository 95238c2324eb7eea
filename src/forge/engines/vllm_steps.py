"""Which weights version produced the tokens that each of vLLM's engine steps returns.

With asynchronous scheduling (vLLM's default on GPU) the engine core launches a step before it
returns the tokens of the one before it (``EngineCore.batch_queue``): when ``LLMEngine.step()``
returns, the next step is already queued on the GPU. A weight update applied between two calls
(in flight) lands after that queued step, so the tokens the next call returns are still the old
weights'. ``StepVersions`` keeps the version each queued step was launched under, from the
queue's length around each call: it grows when a step was launched and none returned, stays
the same when one was launched and the oldest returned, and shrinks when the oldest returned
and none was launched. (vLLM launches its steps on the engine thread's current CUDA stream,
where the weights are copied too, so a queued step never sees part of an update.)

Without asynchronous scheduling (vLLM on CPU, in-flight updates that recompute the caches)
there is no queue: each call runs its own step, with the weights of the moment.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from forge.engines.vllm_config import in_process_core, vllm_version


class StepVersions:
    """Steps vLLM and says which version produced what each step returned. ``batch_queue`` is
    the engine core's queue of launched steps, or None when it has none."""

    def __init__(self, batch_queue: deque | None):
        self._queue = batch_queue
        self._launched: deque[int] = deque()  # the version of each queued step, oldest first

    def step(self, engine_step: Callable[[], list], version: int) -> tuple[list, int]:
        """Runs ``engine_step`` (``LLMEngine.step``) with the weights of ``version`` loaded; returns
        its outputs and the version that produced them."""
        if self._queue is None:
            return engine_step(), version
        if not self._queue:  # every launched step has returned (or vLLM dropped them)
            self._launched.clear()
        before = len(self._queue)
        outputs = engine_step()
        after = len(self._queue)
        produced_by = version
        if before and after <= before:  # the oldest queued step returned
            produced_by = self._launched.popleft()
        if after > before or (before and after == before):  # a step was launched
            self._launched.append(version)
        if len(self._launched) != len(self._queue):
            raise RuntimeError(
                f"lost track of vLLM's queued steps ({len(self._queue)} queued, {len(self._launched)} "
                "recorded): the tokens' versions would be wrong"
            )
        return outputs, produced_by


def batch_queue(llm, key: str) -> deque | None:
    """vLLM's queue of launched steps (asynchronous scheduling), or None when it steps one at a time."""
    config = llm.llm_engine.vllm_config.scheduler_config
    queue = getattr(in_process_core(llm), "batch_queue", None)
    if config.async_scheduling and queue is None:
        raise RuntimeError(
            f"{key}: vLLM {vllm_version()} schedules asynchronously and forge cannot see its queue of "
            "launched steps (EngineCore.batch_queue), so it could not say which weights produced a token"
        )
    return queue
