"""The interface every generation engine implements (native transformers on CPU, vLLM on GPU).

Kept free of transformers and vLLM so that actors and tests can depend on it cheaply.

Logprob semantics (shared by all engines): a reported logprob is the log-probability of the
sampled token under the distribution it was actually sampled from, i.e.
``log_softmax(filtered(logits / temperature))`` where ``filtered`` applies top-k and then
top-p by setting the removed logits to ``-inf``. With ``top_k=0`` and ``top_p=1`` (the
setting for RL training) this is exactly ``log_softmax(logits / temperature)``, which is
what the trainer recomputes, so the importance ratio is 1 for on-policy data. With
filtering on, the reported values are renormalized over the kept tokens and no longer
match the trainer's unfiltered recomputation. ``temperature=0`` means greedy decoding;
its logprobs are those of the unscaled distribution, ``log_softmax(logits)``.

Seeding (shared by all engines): with ``SamplingParams.seed`` set, sample ``j`` of prompt
``i`` draws from its own random stream, seeded by ``sample_seed(seed, keys[i], j)``, where
``keys[i]`` is the prompt's sample key given by the caller (``generate(..., sample_keys=)``,
e.g. the prompt's position in the dataset's stream) and defaults to ``i``. A sample thus
depends on the seed, its prompt's key and its index, not on which call or batch it was
drawn in: two runs that generate the same (prompt, key) pairs in any grouping draw the same
samples, which is what exact resume and the async == serial check need. (vLLM maps this to
one request per prompt with ``seed=sample_seed(seed, keys[i])``.) Without a seed, engines
draw from the process's global RNG.

Stop strings (shared by all engines, which need the tokenizer for them): a sample ends at the
first token whose decoding completes one of ``SamplingParams.stop`` in the response text (as
``Completion.text`` shows it: special tokens skipped; the prompt's text is not searched). That
token is kept whole, like a stop token: a stop string split over several tokens (``</`` ``tool``
``>``) ends at the last of them, and a token holding more than the stop string (``></tool>x``)
is kept with its extra characters, so that training sees the decision to stop and the kept
logprobs stay those of the kept tokens. Later tokens and their logprobs are dropped, and the
stop reason is "stop". (vLLM's own ``stop`` needs its tokenizer and drops the stop string's
text; forge runs vLLM without a tokenizer.)
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from forge.data.types import Completion, StopReason

if TYPE_CHECKING:  # an engine's weights are torch tensors; the configs and types here need no torch
    import torch


class SamplingParams(BaseModel):
    """How to sample. Field names and meanings follow vLLM's ``SamplingParams``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    n: int = Field(default=1, ge=1, description="samples per prompt")
    temperature: float = Field(default=1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="1 disables nucleus filtering")
    top_k: int = Field(default=0, ge=0, description="0 disables top-k filtering")
    max_tokens: int = Field(default=64, ge=1, description="most tokens generated per sample")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, description="tokens that end a sample, in addition to the model's eos"
    )
    stop: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        description="strings that end a sample at the token completing one (kept, see the module docstring)",
    )
    seed: int | None = Field(
        default=None,
        ge=0,
        description="base seed: each sample is seeded by (seed, its prompt's key, its index)",
    )


@dataclass
class GeneratedSequence:
    """One sample. ``token_ids`` include the stop token when ``stop_reason == "stop"``, so
    that training sees (and learns) the decision to stop; ``logprobs`` has one entry per
    token, with the semantics described in this module's docstring."""

    token_ids: list[int]
    logprobs: list[float]
    stop_reason: StopReason
    # The weights version that produced each token, when weights changed while the sample ran
    # (an in-flight update); None: all of it by the version its engine reports.
    token_versions: list[int] | None = None


class StopStrings:
    """The stop-string rule of the module docstring, for one tokenizer and one list of strings.

    Only the last ``window`` tokens are decoded at each position, so that checking every new
    token costs the same however long the response is: the tokens that make up a stop string of
    n characters are at most 4n (a character has at most 4 bytes, a token at least one), and 4
    more before them let the window decode as it does within the whole text (a leading space, a
    character cut in bytes). Special tokens decode to nothing: a stop string with more than 4 of
    them inside it could be missed."""

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.window = 4 * max(len(s) for s in stop) + 4

    def ends_with_stop(self, token_ids: Sequence[int]) -> bool:
        """Whether the last of ``token_ids`` (a response so far) completes a stop string."""
        text = self.tokenizer.decode(token_ids[-self.window :], skip_special_tokens=True)
        return any(s in text for s in self.stop)

    def truncate(self, sequence: GeneratedSequence) -> GeneratedSequence:
        """``sequence`` cut after the first token that completes a stop string (unchanged when none does)."""
        text = self.tokenizer.decode(sequence.token_ids, skip_special_tokens=True)
        if not any(s in text for s in self.stop):  # the usual case: one decode
            return sequence
        for end in range(1, len(sequence.token_ids) + 1):
            if self.ends_with_stop(sequence.token_ids[:end]):
                versions = sequence.token_versions[:end] if sequence.token_versions else None
                return GeneratedSequence(sequence.token_ids[:end], sequence.logprobs[:end], "stop", versions)
        return sequence


def stop_strings(tokenizer, params: SamplingParams) -> StopStrings | None:
    """The engines' stop strings for ``params``: None when there are none."""
    if not params.stop:
        return None
    if tokenizer is None:
        raise ValueError(
            "generator.sampling.stop needs the engine to decode tokens, but it was built without a "
            "tokenizer: pass tokenizer= to the engine (the Generator actor does)"
        )
    return StopStrings(tokenizer, params.stop)


def sample_seed(*parts: int) -> int:
    """A 63-bit seed from integers (a stable hash: the same in every process and run)."""
    digest = hashlib.blake2b(",".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class GenerationEngine(ABC):
    """Samples completions and receives new weights in Hugging Face parameter names."""

    @abstractmethod
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        sample_keys: Sequence[int] | None = None,
    ) -> list[list[GeneratedSequence]]:
        """Returns ``params.n`` samples for each prompt, in prompt order. ``sample_keys`` (one
        per prompt) choose the random streams when ``params.seed`` is set (module docstring)."""

    @abstractmethod
    def hf_state_dict_template(self) -> dict[str, torch.Tensor]:
        """Uninitialized tensors with the HF names, shapes, dtypes and device that
        ``load_hf_state_dict`` expects, newly allocated (vLLM with its model in other processes:
        views of its one shared receive buffer, the same at every call). Weight sync takes them
        once, receives every version into them, then calls ``load_hf_state_dict``."""

    @abstractmethod
    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copies the weights into the engine's parameters in place. Raises ``ValueError``
        naming missing/unexpected keys and shape mismatches, before copying anything."""

    @abstractmethod
    def load_hf_weights(self, chunks: Iterable[dict[str, torch.Tensor]]) -> None:
        """Like ``load_hf_state_dict`` for some of the weights only (LoRA's merged layers,
        ``forge.engines.lora_sync``), given in chunks: each is loaded before the next is asked
        for, so a chunk's tensors may be overwritten by the next. The others keep their values."""

    @abstractmethod
    def hf_weight_shapes(self) -> dict[str, torch.Size]:
        """The shape of each weight ``load_hf_state_dict`` takes, by Hugging Face name."""

    @property
    @abstractmethod
    def receive_device(self) -> torch.device:
        """Where received weights go before they load (``hf_state_dict_template``'s device)."""


class VersionedSamples(NamedTuple):
    """What a concurrent engine returns: the samples, and the weights version their first
    tokens were sampled by (all of them, unless a sample's ``token_versions`` says otherwise)."""

    version: int
    samples: list[list[GeneratedSequence]]


class ConcurrentGenerationEngine(GenerationEngine):
    """An engine that serves overlapping requests itself (continuous batching) and changes
    weights while they run. With ``update_mode == "drain"`` requests running when new weights
    arrive finish on the old ones and requests that start later run on the new ones; with
    ``"in_flight"`` the running ones continue on the new weights from their next token. The
    engine, not its caller, knows which version produced each token, so it reports it.

    The async methods never block the event loop they are awaited on, so an actor can keep
    accepting calls while the engine works.
    """

    # Seconds the last weight update took inside the engine, not counting the wait for the
    # requests that were running.
    last_load_seconds: float = 0.0
    update_mode: str = "drain"

    @abstractmethod
    async def generate_async(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        sample_keys: Sequence[int] | None = None,
    ) -> VersionedSamples:
        """Like ``generate``, served together with whatever else is running."""

    @abstractmethod
    async def load_hf_state_dict_async(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Loads ``state_dict`` as ``version``: in drain mode once the requests now running have
        finished (requests that arrive meanwhile wait, then start on ``version``), in flight
        at the next step of the running ones. Returns when loaded. ``state_dict`` must not
        change until then."""

    @abstractmethod
    async def load_hf_weights_async(self, chunks: Iterable[dict[str, torch.Tensor]], version: int) -> None:
        """``load_hf_state_dict_async`` for some of the weights only, in chunks (``load_hf_weights``):
        the chunks are made and loaded once the engine is ready to load."""

    def take_running_samples(self) -> tuple[float, int] | None:
        """The mean and the most samples the engine ran at once per step since the last call;
        None when it cannot tell."""
        return None


def to_completions(
    prompts: Sequence[str],
    prompt_ids: Sequence[Sequence[int]],
    outputs: list[list[GeneratedSequence]],
    tokenizer,
    policy_version: int,
) -> list[list[Completion]]:
    """An engine's samples as `Completion`s (text decoded without special tokens), each with
    the oldest version that produced a token of it, and per-token versions when they differ."""
    return [
        [
            Completion(
                prompt=prompt,
                prompt_ids=list(ids),
                response_ids=seq.token_ids,
                logprobs=seq.logprobs,
                text=tokenizer.decode(seq.token_ids, skip_special_tokens=True),
                stop_reason=seq.stop_reason,
                policy_version=min(seq.token_versions or [policy_version]),
                token_versions=seq.token_versions
                if seq.token_versions and len(set(seq.token_versions)) > 1
                else None,
            )
            for seq in group
        ]
        for prompt, ids, group in zip(prompts, prompt_ids, outputs, strict=True)
    ]


def check_generate_inputs(prompt_ids: Sequence[Sequence[int]], sample_keys: Sequence[int] | None) -> None:
    """What every engine's ``generate`` refuses: an empty prompt, or not one sample key per prompt."""
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token (e.g. a bos token); got an empty prompt")
    if sample_keys is not None and len(sample_keys) != len(prompt_ids):
        raise ValueError(f"{len(sample_keys)} sample keys for {len(prompt_ids)} prompts: give one per prompt")


def check_model_dir(path: str, key: str) -> None:
    """Fails early, naming the config key, when `path` is not a local Hugging Face model dir."""
    import os

    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{key}: model directory '{path}' does not exist; point it at a local Hugging Face "
            "directory (config.json, *.safetensors, tokenizer files)"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        # A run's directory holds its exported model in export/ (what a user most often means).
        export = os.path.join(path, "export")
        hint = (
            f": it looks like a run's directory, whose exported model is {key}={export}"
            if os.path.isfile(os.path.join(export, "config.json"))
            else ""
        )
        raise FileNotFoundError(
            f"{key}: '{path}' has no config.json, so it is not a Hugging Face model directory{hint}"
        )
