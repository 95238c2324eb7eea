"""The requests of one ``VLLMEngine.generate`` call, from vLLM's outputs back to samples.

In drain mode weights never change under a request, so vLLM reports each request once, when
it finishes (``FINAL_ONLY``), and the whole call carries one version. In flight, weights can
change between two engine steps, so vLLM reports every step's new tokens (``DELTA``) and each
token is stamped with the version the engine ran that step with.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

from forge.engines.generation import GeneratedSequence, SamplingParams, StopStrings, VersionedSamples


@dataclass
class _Sample:
    """One of a request's n samples, as its tokens arrive."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    def extend(self, completion, version: int) -> None:
        new = list(completion.token_ids)
        self.token_ids += new
        self.logprobs += _sampled_logprobs(new, completion.logprobs)
        self.versions += [version] * len(new)
        if completion.finish_reason is not None:
            self.finish_reason = completion.finish_reason

    def sequence(self) -> GeneratedSequence:
        # Versions only where they differ: a sample that saw no update is all `Batch.version`.
        versions = self.versions if len(set(self.versions)) > 1 else None
        return GeneratedSequence(self.token_ids, self.logprobs, _stop_reason(self.finish_reason), versions)


@dataclass
class Batch:
    """One generate call: its prompts, the future its caller waits on, and its results."""

    prompt_ids: list[list[int]]
    params: SamplingParams
    sample_keys: list[int]
    stops: StopStrings | None
    future: concurrent.futures.Future
    samples: list[list[GeneratedSequence] | None] = field(default_factory=list)
    remaining: int = 0
    version: int = 0  # the engine's version when the call was admitted
    streaming: bool = False  # in flight: token by token (DELTA), else finished requests only
    _partial: dict[int, list[_Sample]] = field(default_factory=dict)

    def admitted(self, version: int, streaming: bool) -> None:
        self.version, self.streaming = version, streaming
        self.samples = [None] * len(self.prompt_ids)
        self.remaining = len(self.prompt_ids)
        if streaming:
            self._partial = {i: [_Sample() for _ in range(self.params.n)] for i in range(self.remaining)}

    def collect(self, index: int, output, version: int) -> None:
        """vLLM's output for prompt `index`, produced by `version`; completes the future when it
        was the call's last unfinished request."""
        if self.streaming:
            for completion in output.outputs:
                self._partial[index][completion.index].extend(completion, version)
        if not output.finished:
            return
        samples = (
            [s.sequence() for s in self._partial.pop(index)]
            if self.streaming
            else [_final_sequence(completion) for completion in output.outputs]
        )
        self.samples[index] = samples if self.stops is None else [self.stops.truncate(s) for s in samples]
        self.remaining -= 1
        if self.remaining == 0:
            settle(self.future, VersionedSamples(self.version, self.samples))


def settle(future: concurrent.futures.Future, result=None, error: BaseException | None = None) -> None:
    """Completes `future` unless its caller gave up on it (cancelled: a deadline, a shutdown);
    the engine thread must go on serving the others."""
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _sampled_logprobs(token_ids: list[int], positions) -> list[float]:
    # With logprobs=0 each position holds the sampled token's logprob (and no others).
    return [position[token].logprob for token, position in zip(token_ids, positions, strict=True)]


def _stop_reason(finish_reason: str | None) -> str:
    return "stop" if finish_reason == "stop" else "length"


def _final_sequence(completion) -> GeneratedSequence:
    token_ids = list(completion.token_ids)
    return GeneratedSequence(
        token_ids=token_ids,
        logprobs=_sampled_logprobs(token_ids, completion.logprobs),
        stop_reason=_stop_reason(completion.finish_reason),
    )
