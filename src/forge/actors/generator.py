"""Generator: samples completions with per-token logprobs; loads new weights from the store.

Every `Completion` carries the oldest weights version that produced one of its tokens
(`policy_version`), and the version of each token when they differ (`token_versions`).

With `sampling.seed` set, a sample is seeded by (seed, its prompt's sample key, its index):
the rollout passes each prompt's position in the dataset's stream as its key, so a run
draws the same samples however its prompts are batched, and a resumed run continues them.
Calls without keys use the ordinal of the call instead.

The generator samples from token ids, as they are: prompts are rendered by the caller, with one
renderer (`forge.data.chat_prompts.PromptRenderer`): rollouts and the eval in the rollout
(`forge.rollout.groups`), a judge's questions in its client (`forge.actors.reward_models`),
with the judge's tokenizer. `Completion.prompt` is the ids decoded (rollouts keep the text they
rendered). Stop strings (`sampling.stop`) are applied by the engines, which get the tokenizer
for them.

Weights: before each request the generator loads the newest complete version in the store,
if there is a newer one (`forge.weight_sync.WeightPuller`); a request can ask for at least
`min_version` and then waits for it. `update_weights(v)` loads exactly `v`. With LoRA a version
is the trainer's adapters alone, merged into the engine's weights or served by vLLM as a LoRA
adapter (`generator.lora_sync`, `forge.engines.lora_sync`).

`generate` is a concurrent endpoint: each call runs as its own task, so
the rollout loops' calls reach the engine together. The vLLM engine serves them in shared
batches from its own thread and takes new weights as `update_mode` says: `drain` (running
requests finish on the old weights) or `in_flight` (they continue on the new ones from their
next token; then a background task also loads each version as soon as it is published, rather
than at the next request). The native engine samples synchronously, so weights never change
under it. One weight load runs at a time (a lock: they share the receive buffers).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import time
from typing import Any, Literal

import torch
from monarch.actor import concurrent_endpoint, endpoint
from pydantic import Field, model_validator

from forge.config import ForgeConfigModel
from forge.controller import ForgeActor
from forge.controller.liveness import CallDeadline, Probe
from forge.data.types import Completion
from forge.engines.generation import ConcurrentGenerationEngine, SamplingParams, sample_seed, to_completions
from forge.engines.lora_sync import AdapterSync, LoraSyncMode, MergeOnArrival
from forge.engines.vllm_config import UpdateMode, VLLMConfig, check_kept_cache
from forge.observability import Reduce, record_metric
from forge.weight_sync import WeightPuller
from forge.weight_transports import build_transport

logger = logging.getLogger(__name__)


class GeneratorConfig(ForgeConfigModel):
    # A local Hugging Face directory (config.json, *.safetensors, tokenizer files); the GRPO
    # run's policy_path when unset.
    model_path: str | None = None
    # The engine behind the `GenerationEngine` interface: `vllm`, or `hf` (native transformers).
    # `auto` takes vllm where CUDA is available (and vllm installed), hf otherwise: on CPU the
    # native engine is much faster for the tiny demo models.
    engine: Literal["auto", "vllm", "hf"] = "auto"
    dtype: Literal["float32", "bfloat16"] = "float32"
    vllm: VLLMConfig = VLLMConfig()
    # How the vLLM engine takes a new policy version (forge.engines.vllm): `drain` waits for the
    # running requests to finish on the old weights; `in_flight` applies it between two steps
    # and the running requests continue on it (per-token versions; whether their caches are
    # recomputed is generator.vllm.in_flight_kv_cache). The hf engine always drains.
    update_mode: UpdateMode = "drain"
    sampling: SamplingParams = SamplingParams()
    # More than 1 runs the generators as a service: a replica that dies is replaced, and the
    # replacement loads the newest published weights before it serves.
    replicas: int = Field(1, ge=1)
    # Replicas that share each generator GPU (each a process of its own). vLLM's loop runs on
    # one host thread: at 0.6B with 512 sequences it keeps an H100 only about half busy
    # (bench/RESULTS.md, issue 28), so two replicas of a small model fill one GPU better than
    # one. Their memory shares (generator.vllm.gpu_memory_utilization) must fit the GPU together.
    replicas_per_gpu: int = Field(1, ge=1)
    # How new weights reach this generator (forge.weight_transports): auto is cuda_ipc when the run
    # has GPUs, shm on CPU (trainer and generator on one host), store across hosts (its traffic
    # keeps the mesh's TLS); broadcast sends every trainer rank's rows to all replicas at once
    # (NCCL; gloo on CPU), any placement, without TLS.
    weight_transport: Literal["auto", "store", "cuda_ipc", "shm", "broadcast"] = "auto"
    # Compare an exact checksum of every received version with the trainer's (costs one pass
    # over the weights on each side per sync; for debugging a transport).
    verify_weights: bool = False
    # With LoRA (trainer.engine.lora) the trainer publishes its adapters alone, and this is how the
    # generator takes them (forge.engines.lora_sync): `merge` them into its weights on arrival
    # (any engine), or `vllm_lora`: vLLM serves them with its own LoRA support (vLLM only; drain
    # updates only). None: merge when the trainer has LoRA.
    lora_sync: LoraSyncMode | None = None
    # Liveness (forge.controller.liveness): a generate call that misses its deadline, or an idle
    # replica that misses a probe, has hung: it is killed and replaced (replicas > 1), or the
    # run stops naming it.
    deadline: CallDeadline = CallDeadline()
    probe: Probe = Probe()

    @model_validator(mode="after")
    def _modes_need_vllm(self) -> GeneratorConfig:
        for setting, on in (
            (f"generator.update_mode={self.update_mode}", self.update_mode == "in_flight"),
            ("generator.vllm.sleep_during_train=true", self.vllm.sleep_during_train),
        ):
            if on and self.engine == "hf":
                raise ValueError(
                    f"{setting} needs generator.engine=vllm (the hf engine samples synchronously)"
                )
        return self

    @model_validator(mode="after")
    def _kept_cache_is_in_flight(self) -> GeneratorConfig:
        check_kept_cache(self.vllm, self.update_mode, "generator")
        return self

    @model_validator(mode="after")
    def _vllm_lora_needs_vllm_drain(self) -> GeneratorConfig:
        if self.lora_sync != "vllm_lora":
            return self
        if self.engine == "hf":
            raise ValueError(
                "generator.lora_sync=vllm_lora is vLLM's own LoRA serving, and generator.engine is hf: "
                "set generator.engine=vllm, or generator.lora_sync=merge"
            )
        if self.update_mode == "in_flight":
            raise ValueError(
                "generator.lora_sync=vllm_lora with generator.update_mode=in_flight: a running request "
                "keeps the LoRA adapter it started with, so it cannot change weights in flight; use "
                "generator.update_mode=drain, or generator.lora_sync=merge"
            )
        return self

    @model_validator(mode="after")
    def _room_for_samples(self) -> GeneratorConfig:
        if self.vllm.max_model_len is not None and self.vllm.max_model_len <= self.sampling.max_tokens:
            raise ValueError(
                f"generator.vllm.max_model_len ({self.vllm.max_model_len}) must exceed "
                f"generator.sampling.max_tokens ({self.sampling.max_tokens}): it bounds prompt + response"
            )
        return self


def resolve_engine(engine: str) -> str:
    """`auto` -> `vllm` where CUDA is available and vllm is installed, else `hf`."""
    if engine != "auto":
        return engine
    import torch

    return "vllm" if torch.cuda.is_available() and importlib.util.find_spec("vllm") else "hf"


def build_generation_engine(
    cfg: GeneratorConfig, eos_token_id: int | None, tokenizer=None, lora: AdapterSync | None = None
):
    """The engine named by `cfg.engine` (engines are imported lazily, only when chosen);
    `tokenizer` lets it apply stop strings (`sampling.stop`); `lora` in mode vllm_lora starts
    vLLM with LoRA on."""
    import torch

    engine = resolve_engine(cfg.engine)
    logger.info("generator engine: %s (generator.engine=%s)", engine, cfg.engine)
    vllm_lora = lora is not None and lora.mode == "vllm_lora"
    if vllm_lora and engine != "vllm":
        raise ValueError(
            f"generator.lora_sync=vllm_lora needs the vLLM engine; generator.engine={cfg.engine} took "
            f"{engine}: set generator.engine=vllm, or generator.lora_sync=merge"
        )
    if engine == "vllm":
        from forge.engines.vllm import VLLMEngine

        return VLLMEngine(
            cfg.model_path,
            cfg.vllm,
            dtype=cfg.dtype,
            eos_token_id=eos_token_id,
            tokenizer=tokenizer,
            update_mode=cfg.update_mode,
            lora=lora if vllm_lora else None,
        )

    from transformers import AutoModelForCausalLM

    from forge.engines.hf_generate import HFGenerateEngine

    if cfg.update_mode == "in_flight" or cfg.vllm.sleep_during_train:  # engine=auto chose hf
        logger.warning(
            "generator.engine=auto chose hf here (no CUDA or no vllm): generator.update_mode=%s and "
            "generator.vllm.sleep_during_train=%s apply to vLLM only; the hf engine takes new weights "
            "between requests and never sleeps",
            cfg.update_mode,
            cfg.vllm.sleep_during_train,
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=getattr(torch, cfg.dtype)).to(device)
    # The tokenizer's eos is authoritative: an exported config.json may not carry one.
    return HFGenerateEngine(model, eos_token_id=eos_token_id, tokenizer=tokenizer)


class Generator(ForgeActor):
    def __init__(self, cfg: GeneratorConfig, follows_policy: bool = True, lora: AdapterSync | None = None):
        self.cfg = cfg
        # False: a frozen model (a judge, forge.actors.reward_models) that never loads the
        # weights the trainer publishes.
        self.follows_policy = follows_policy
        # With LoRA the trainer publishes its adapters alone, taken as `lora.mode` says
        # (forge.engines.lora_sync); None: it publishes the whole model.
        self.lora = lora
        self.version = 0
        self._unkeyed_calls = 0
        self._follower: asyncio.Task | None = None  # in flight: loads versions as they come

    @endpoint
    async def setup(self) -> None:
        from transformers import AutoTokenizer

        from forge.engines.generation import check_model_dir

        check_model_dir(self.cfg.model_path, "generator.model_path")
        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model_path)
        self.engine = build_generation_engine(
            self.cfg, self.tokenizer.eos_token_id, self.tokenizer, self.lora
        )
        self._weights = None  # receive buffers, allocated on the first update
        self._merge = None
        if self.follows_policy and self.lora is not None and self.lora.mode == "merge":
            self._merge = MergeOnArrival.from_checkpoint(
                self.lora,
                self.cfg.model_path,
                self.engine.hf_weight_shapes(),
                getattr(torch, self.cfg.dtype),
                self.engine.receive_device,
            )
        self._puller = WeightPuller(
            build_transport(self.cfg.weight_transport, replica=self.replica_index),
            verify=self.cfg.verify_weights,
        )
        self._loading = asyncio.Lock()
        # A replica that replaces a dead one starts from the policy being trained, not model_path.
        await self._pick_up_newest(0)
        engine = self.engine
        if (
            self.follows_policy
            and isinstance(engine, ConcurrentGenerationEngine)
            and engine.update_mode == "in_flight"
        ):
            self._follower = asyncio.create_task(self._follow_policy())

    async def _follow_policy(self, poll_s: float = 0.01) -> None:
        """In flight: loads each version as soon as it is published, while requests run."""
        while True:
            await self._pick_up_newest(0)
            await asyncio.sleep(poll_s)

    def _check_follower(self) -> None:
        """A failed background load (a bad transport, a mismatched state dict) fails the next call."""
        if self._follower is not None and self._follower.done():
            self._follower.result()

    @concurrent_endpoint
    async def generate(
        self,
        prompt_ids: list[list[int]],
        sample_keys: list[int] | None = None,
        min_version: int = 0,
        **sampling: Any,
    ) -> list[list[Completion]]:
        """`n` completions of each prompt, continuing from its token ids as they are (a rendered
        prompt, or a multi-turn trajectory so far), sampled together in one batch (sampling
        defaults from config, overridden by kwargs); `sample_keys` (one per prompt) choose the
        seeded random streams (see the module docstring); the policy is the newest published
        one, and at least `min_version`."""
        await self._pick_up_newest(min_version)
        return await self._generate([list(ids) for ids in prompt_ids], sample_keys, sampling)

    def _receive_buffers(self) -> dict:
        if self._weights is None:
            if self.lora is None:
                self._weights = self.engine.hf_state_dict_template()
            else:
                self._weights = self.lora.template(self.engine.hf_weight_shapes(), self.engine.receive_device)
        return self._weights

    async def _pick_up_newest(self, min_version: int) -> None:
        if not self.follows_policy:
            return
        self._check_follower()
        async with self._loading:
            started = time.perf_counter()
            loaded = await self._puller.pull_newest(self.version, self._receive_buffers(), min_version)
            if loaded is not None:
                await self._load_received(loaded, started)

    async def _load_received(self, version: int, started: float) -> None:
        """Loads the receive buffers into the engine as `version` (under `self._loading`)."""
        engine = self.engine
        # lora_sync merge: the merged weights are made chunk by chunk as the engine loads them
        # (a buffer of one chunk, not of every adapted layer: forge.engines.lora_sync).
        merged = self._merge.chunks(self._weights) if self._merge is not None else None
        if isinstance(engine, ConcurrentGenerationEngine):
            # Each returns once the requests running now have finished and the weights are in.
            if merged is not None:
                await engine.load_hf_weights_async(merged, version)
            elif self.lora is not None:  # vllm_lora
                await engine.load_adapter_async(self._weights, version)
            else:
                await engine.load_hf_state_dict_async(self._weights, version)
            record_metric("generator/weight_load_ms", engine.last_load_seconds * 1e3, Reduce.MEAN)
        elif merged is not None:
            engine.load_hf_weights(merged)
        else:
            engine.load_hf_state_dict(self._weights)
        self.version = version
        if self._merge is not None:
            record_metric("generator/lora_merge_ms", self._merge.merge_seconds * 1e3, Reduce.MEAN)
        record_metric("generator/version", version, Reduce.MAX)
        record_metric("generator/weight_sync_ms", (time.perf_counter() - started) * 1e3, Reduce.MEAN)
        if (published_at := self._puller.last_published_at) is not None:  # one host: one clock
            ready_ms = (time.time() - published_at) * 1e3
            record_metric("generator/publish_to_ready_ms", ready_ms, Reduce.MEAN)
            # With replicas: the last one to be ready, which is what the next rollouts wait for,
            # and each one's.
            record_metric("generator/publish_to_ready_max_ms", ready_ms, Reduce.MAX)
            record_metric(
                f"generator/replica_{self.replica_index}/publish_to_ready_ms", ready_ms, Reduce.MEAN
            )
        record_metric(
            "generator/weight_sync_bytes",
            sum(t.numel() * t.element_size() for t in self._weights.values()),
            Reduce.SUM,
        )

    async def _generate(
        self, prompt_ids: list[list[int]], sample_keys: list[int] | None, overrides: dict[str, Any]
    ) -> list[list[Completion]]:
        # Overrides are validated like config: an unknown or bad sampling key fails here.
        params = SamplingParams.model_validate({**self.cfg.sampling.model_dump(), **overrides})
        if sample_keys is None:
            sample_keys = [sample_seed(self._unkeyed_calls, i) for i in range(len(prompt_ids))]
            self._unkeyed_calls += 1
        started = time.perf_counter()
        if isinstance(self.engine, ConcurrentGenerationEngine):
            version, outputs = await self.engine.generate_async(prompt_ids, params, sample_keys)
            # Fewer samples running at once than the rollout gives a replica: its KV cache is full.
            if (running := self.engine.take_running_samples()) is not None:
                record_metric("generator/running_samples", running[0], Reduce.MEAN)
                record_metric("generator/running_samples_max", running[1], Reduce.MAX)
        else:
            # Synchronous: no weight load can run between reading the version and sampling.
            version, outputs = self.version, self.engine.generate(prompt_ids, params, sample_keys)
        elapsed = time.perf_counter() - started
        tokens = sum(len(seq.token_ids) for group in outputs for seq in group)
        record_metric("generator/tokens_per_s", tokens / max(elapsed, 1e-9), Reduce.MEAN)
        record_metric("generator/generated_tokens", tokens, Reduce.SUM)
        texts = [self.tokenizer.decode(ids) for ids in prompt_ids]
        return to_completions(texts, prompt_ids, outputs, self.tokenizer, version)

    @endpoint
    async def update_weights(self, version: int) -> None:
        """Loads `version` (waiting for it to be published) into preallocated buffers, then
        into the engine."""
        async with self._loading:
            if version == self.version:
                return
            started = time.perf_counter()
            await self._puller.pull(version, self._receive_buffers())
            await self._load_received(version, started)

    @endpoint
    async def get_version(self) -> int:
        return self.version

    @concurrent_endpoint
    async def stop_pulling(self) -> None:
        """Returns once no call to the weight store is in flight and none will start: before
        this actor's process stops, since the store's controller fails (and the store with it)
        when its reply to a stopped process cannot be delivered."""
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
        if not self.follows_policy:
            return
        self._puller.stop()
        async with self._loading:  # a pull under way finishes first
            pass

    @endpoint
    async def sleep(self, asleep: bool) -> None:
        """vLLM sleeps (KV cache freed, weights in host memory) or wakes up: the training loop
        brackets train steps with it when `generator.vllm.sleep_during_train` is set."""
        sleep_async = getattr(self.engine, "sleep_async", None)
        if sleep_async is None:  # the hf engine (generator.engine=auto without vLLM) never sleeps
            return
        started = time.perf_counter()
        await sleep_async(asleep)
        record_metric(
            f"generator/{'sleep' if asleep else 'wake'}_ms",
            (time.perf_counter() - started) * 1e3,
            Reduce.MEAN,
        )


async def stop_pulling(generator, timeout_s: float = 5.0) -> None:
    """`Generator.stop_pulling` on every replica (a run's end). A generator that died or
    hangs has no store call to finish: it is not waited for."""
    try:
        await asyncio.wait_for(generator.stop_pulling.fanout(), timeout_s)
    except Exception as e:
        logger.warning("generator stop_pulling: %s", e or type(e).__name__)
