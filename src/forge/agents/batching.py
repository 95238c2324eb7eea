"""Concurrent agent calls batched into generate calls, turn by turn.

Agents call the endpoint one conversation at a time, but a rollout runs many episodes at once;
a generate call per agent call would hand the generator batches of one. The calls of one
rollout (one ``generate``) are held until every episode of it still running waits on a call,
as the environments' rollouts batch every trajectory's turn, and then sent together: one
generate call for each group of calls that sample alike (n, token limit, temperature, stop
strings). A batch is so the same whatever order the calls arrived in, which keeps a run in
sync mode deterministic (the generator's numbers depend on a batch's composition). An episode
whose agent is busy elsewhere (a slow tool, a hang until its timeout) holds nobody for longer
than ``idle_s`` after the latest call arrived.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from forge.data.types import Completion
from forge.rollout.groups import Generate


@dataclass
class _Calls:
    """The calls of one rollout waiting for their batch, by their sampling settings."""

    queued: dict[Hashable, list[tuple[list[int], int, asyncio.Future]]] = field(default_factory=dict)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    sender: asyncio.Task | None = None

    def waiting(self) -> int:
        return sum(len(calls) for calls in self.queued.values())


class CallBatcher:
    """Sends calls through their `generate` in batches (see the module docstring); `running`
    counts a rollout's episodes that have not ended."""

    def __init__(self, running: Callable[[Generate], int], idle_s: float = 0.05) -> None:
        self.running, self.idle_s = running, idle_s
        self._rollouts: dict[Generate, _Calls] = {}

    async def sample(
        self, generate: Generate, prompt_ids: list[int], key: int, **sampling
    ) -> list[Completion]:
        """The samples of one prompt, seeded by `key`, as `generate(..., **sampling)` gives them."""
        calls = self._rollouts.setdefault(generate, _Calls())
        settings = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in sampling.items()))
        answer = asyncio.get_running_loop().create_future()
        calls.queued.setdefault(settings, []).append((prompt_ids, key, answer))
        self.changed(generate)
        return await answer

    def changed(self, generate: Generate) -> None:
        """A call arrived or an episode of `generate`'s rollout ended: its batch may be complete."""
        calls = self._rollouts.get(generate)
        if calls is None:
            return
        calls.arrived.set()
        if calls.sender is None and calls.queued:
            calls.sender = asyncio.ensure_future(self._send(generate, calls))

    async def _send(self, generate: Generate, calls: _Calls) -> None:
        try:
            while calls.queued:
                while calls.waiting() < self.running(generate):
                    calls.arrived.clear()
                    try:
                        await asyncio.wait_for(calls.arrived.wait(), self.idle_s)
                    except TimeoutError:
                        break
                batches, calls.queued = calls.queued, {}
                await asyncio.gather(*(_sample(generate, dict(s), batch) for s, batch in batches.items()))
        finally:
            calls.sender = None
            if not calls.queued:
                self._rollouts.pop(generate, None)


async def _sample(
    generate: Generate, sampling: dict, batch: list[tuple[list[int], int, asyncio.Future]]
) -> None:
    """One generate call for `batch`, its samples (or its error, which each call's agent then
    sees as the endpoint's 500) handed to each call."""
    try:
        outputs = await generate([ids for ids, _, _ in batch], [key for _, key, _ in batch], **sampling)
    except Exception as e:
        outputs = [e] * len(batch)
    for (_, _, answer), samples in zip(batch, outputs, strict=True):
        if answer.done():  # its agent gave up on it
            continue
        if isinstance(samples, Exception):
            answer.set_exception(samples)
        else:
            answer.set_result(samples)
