"""Concurrent agent calls batched into generate calls.

Agents call the endpoint one conversation at a time, but a rollout runs many episodes at once;
a generate call per agent call would hand the generator batches of one. Calls that sample alike
(the same generate call, i.e. the same rollout, and the same n, token limit, temperature and
stop strings) are queued and sent together: the first starts a batch once every coroutine
ready to run has had its turn, and the calls that arrive while a batch samples make the next.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from dataclasses import dataclass, field

from forge.data.types import Completion
from forge.rollout.groups import Generate


@dataclass
class _Queue:
    prompts: list[list[int]] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    answers: list[asyncio.Future] = field(default_factory=list)
    sending: bool = False


class CallBatcher:
    """Sends calls through their `generate` in batches (see the module docstring)."""

    def __init__(self) -> None:
        self._queues: dict[Hashable, _Queue] = {}

    async def sample(
        self, generate: Generate, prompt_ids: list[int], key: int, **sampling
    ) -> list[Completion]:
        """The samples of one prompt, seeded by `key`, as `generate(..., **sampling)` gives them."""
        settings = (generate, tuple(sorted((k, _hashable(v)) for k, v in sampling.items())))
        queue = self._queues.setdefault(settings, _Queue())
        answer = asyncio.get_running_loop().create_future()
        queue.prompts.append(prompt_ids)
        queue.keys.append(key)
        queue.answers.append(answer)
        if not queue.sending:
            queue.sending = True
            asyncio.ensure_future(self._send(settings, queue, generate, sampling))
        return await answer

    async def _send(self, settings: Hashable, queue: _Queue, generate: Generate, sampling: dict) -> None:
        try:
            while queue.prompts:
                await asyncio.sleep(0)  # the calls that are ready join this batch
                prompts, keys, answers = queue.prompts, queue.keys, queue.answers
                queue.prompts, queue.keys, queue.answers = [], [], []
                try:
                    outputs = await generate(prompts, keys, **sampling)
                except Exception as e:  # each call's agent sees it (the endpoint answers 500)
                    for answer in answers:
                        if not answer.done():
                            answer.set_exception(e)
                    continue
                for answer, samples in zip(answers, outputs, strict=True):
                    if not answer.done():  # its agent may have given up on it
                        answer.set_result(samples)
        finally:
            queue.sending = False
            if self._queues.get(settings) is queue and not queue.prompts:
                del self._queues[settings]


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value
