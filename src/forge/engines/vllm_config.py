"""vLLM's settings (``generator.vllm``) and the ``vllm.LLM`` arguments made from them, apart
from the engine (forge.engines.vllm) so that configs load without it and benchmarks can build
plain vLLM with the same arguments."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from forge.config import ForgeConfigModel

if TYPE_CHECKING:
    import torch

# How new weights enter a running engine (forge.engines.vllm): after the running requests
# finish, or between two steps of them.
UpdateMode = Literal["drain", "in_flight"]


class VLLMConfig(ForgeConfigModel):
    """vLLM's own settings (``generator.vllm``); the dtype is ``generator.dtype``."""

    # The share of GPU memory vLLM may use (weights, activations, KV cache); vLLM's default.
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    # The KV cache size in GiB; when set it replaces what gpu_memory_utilization leaves. None:
    # that remainder on GPU, and 0.25 GiB on CPU, where gpu_memory_utilization would be the share
    # of all RAM for this process, its own memory included (it fails when the process is big).
    kv_cache_memory_gib: float | None = Field(default=None, gt=0.0)
    # None: the model's max_position_embeddings.
    max_model_len: int | None = Field(default=None, ge=2)
    tensor_parallel_size: int = Field(default=1, ge=1)
    # vLLM's own all-reduce kernels for tensor parallelism: its custom all-reduce (over CUDA IPC
    # buffers) and FlashInfer's all-reduce fused with RMSNorm (a compile pass). Off: NCCL's.
    # On the project's 4 x H200 machine TP=2 failed at start-up with them (FlashInfer chose its
    # multi-node NVLink backend; an illegal memory access in the first profile run, reported as
    # CUBLAS_STATUS_INTERNAL_ERROR on every rank).
    custom_all_reduce: bool = False
    # None: eager on CPU (vLLM's CPU backend), compiled with CUDA graphs on GPU.
    enforce_eager: bool | None = None
    # n samples of one prompt share its KV cache; weight updates clear the cache (in flight with
    # the caches kept, requests are salted with their version instead: forge.engines.vllm).
    enable_prefix_caching: bool = True
    seed: int = Field(default=0, ge=0)
    # In flight (generator.update_mode=in_flight), what an update does to the keys and values the
    # running requests have cached: `recompute` preempts them, so vLLM recomputes their caches
    # under the new weights and every later token is exactly the new policy's (a pause as long as
    # a prefill of everything running); `keep` leaves the caches as the old weights wrote them and
    # goes on at once (PipelineRL's in-flight updates): a token sampled after the update attends
    # to earlier tokens through the old weights' keys and values. Its logprob is still the one it
    # was sampled with, which is what the loss's importance ratio needs.
    in_flight_kv_cache: Literal["recompute", "keep"] = "recompute"
    # Colocated runs: vLLM sleeps through each train step (its KV cache freed, its weights kept
    # in host memory), so the trainer can use that GPU memory; it wakes for the next rollout.
    # vLLM's sleep mode, CUDA only; for max_policy_age 0, where nothing generates while training.
    sleep_during_train: bool = False


def llm_kwargs(model_path: str, config: VLLMConfig, dtype: torch.dtype, on_gpu: bool) -> dict[str, Any]:
    """The arguments of ``vllm.LLM`` for this engine (benchmarks build plain vLLM with them too)."""
    in_process()
    kwargs: dict[str, Any] = {}
    if config.max_model_len is not None:
        kwargs["max_model_len"] = config.max_model_len
    kv_cache = kv_cache_gib(config, on_gpu)
    if kv_cache is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache * 2**30)
    if config.sleep_during_train:
        kwargs["enable_sleep_mode"] = True
    if not config.custom_all_reduce:
        kwargs["compilation_config"] = {"pass_config": {"fuse_allreduce_rms": False}}
    return dict(
        model=model_path,
        # Prompts arrive as token ids and samples leave as token ids: no tokenizer.
        skip_tokenizer_init=True,
        dtype=str(dtype).removeprefix("torch."),
        seed=config.seed,
        gpu_memory_utilization=config.gpu_memory_utilization,
        tensor_parallel_size=config.tensor_parallel_size,
        disable_custom_all_reduce=not config.custom_all_reduce,
        enforce_eager=config.enforce_eager if config.enforce_eager is not None else not on_gpu,
        enable_prefix_caching=config.enable_prefix_caching,
        # Logprobs after temperature and top-k/top-p: the distribution sampled from.
        logprobs_mode="processed_logprobs",
        # Sampling settings are ours only, never the model's generation_config.json.
        generation_config="vllm",
        **kwargs,
    )


def check_kept_cache(config: VLLMConfig, update_mode: str, key: str) -> None:
    """Refuses kept caches (`in_flight_kv_cache=keep`) where no request runs across an update."""
    if config.in_flight_kv_cache == "keep" and update_mode != "in_flight":
        raise ValueError(
            f"{key}.vllm.in_flight_kv_cache=keep says what an in-flight update does to the running "
            f"requests' caches, and {key}.update_mode is {update_mode}, where no request runs "
            f"across an update: set {key}.update_mode=in_flight, or leave in_flight_kv_cache out"
        )


def kv_cache_gib(config: VLLMConfig, on_gpu: bool) -> float | None:
    """The size of each worker's KV cache, in GiB; None on a GPU without `kv_cache_memory_gib`,
    where vLLM gives it what `gpu_memory_utilization` leaves once its weights are loaded."""
    return config.kv_cache_memory_gib or (None if on_gpu else 0.25)


def in_process_core(llm):
    """vLLM's engine core (its scheduler, its queue of launched steps) when it runs in this
    process, as `in_process` keeps it; None when it runs in a process of its own."""
    return getattr(llm.llm_engine.engine_core, "engine_core", None)


def in_process() -> None:
    """Keeps vLLM's engine core in this process (set before vllm is imported): the
    multiprocessing core spawns a process that needs a `__main__` guard, and its RPCs would
    pickle every weight update. (With tensor parallelism vLLM still starts one worker per GPU.)"""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # Tensor-parallel workers are started by spawning, never forking: in a generator actor vLLM
    # found CUDA not yet initialised, forked, and every worker failed with "Cannot re-initialize
    # CUDA in forked subprocess" (bench/RESULTS.md, seventeenth session).
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # Symmetric-memory all-reduce needs NVLink multicast, which must stay off on shared hosts.
    os.environ.setdefault("VLLM_ALLREDUCE_USE_SYMM_MEM", "0")


def check_supported(hf_config, model_path: str, key: str, on_gpu: bool) -> None:
    """Refuses, naming `key`, a model whose architecture vLLM lacks, or (on CPU) whose head size
    vLLM's CPU attention cannot run."""
    from vllm import ModelRegistry

    architectures = list(getattr(hf_config, "architectures", None) or [])
    supported = set(ModelRegistry.get_supported_archs())
    if not architectures or not supported.intersection(architectures):
        raise ValueError(
            f"{key}.model_path: '{model_path}' has architecture {architectures or 'none'}, "
            f"which vLLM {vllm_version()} does not support; use {key}.engine=hf, or a model "
            "vLLM supports (e.g. Qwen3ForCausalLM, LlamaForCausalLM)"
        )
    if not on_gpu:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        text_config = hf_config.get_text_config()
        head_dim = getattr(text_config, "head_dim", None) or (
            text_config.hidden_size // text_config.num_attention_heads
        )
        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in sizes:
            raise ValueError(
                f"{key}.model_path: head size {head_dim} of '{model_path}' is not supported "
                f"by vLLM's CPU attention (supported: {sizes}); use {key}.engine=hf on CPU"
            )


def check_fits(prompt_ids, max_tokens: int, max_model_len: int, key: str) -> None:
    """Refuses, naming the keys, prompts that leave no room for `max_tokens` within vLLM's
    `max_model_len`."""
    longest = max(len(p) for p in prompt_ids)
    if longest + max_tokens > max_model_len:
        raise ValueError(
            f"{key}.vllm.max_model_len is {max_model_len}, below the longest prompt "
            f"({longest} tokens) + {key}.sampling.max_tokens ({max_tokens}); raise "
            f"{key}.vllm.max_model_len (at most the model's max_position_embeddings) or "
            "shorten the prompts or max_tokens"
        )


# vLLM's GPU sampler holds at most this many biased ids, and as many allowed ids, per request.
MAX_MASKED_IDS = 1024


def unsampled_rows_params(tokenizer_rows: int, vocab_rows: int, key: str, model_path: str) -> dict[str, Any]:
    """The request settings that keep vLLM from sampling the vocabulary rows past the tokenizer:
    a -inf bias on those rows when they are few (Qwen pads 267), else the tokenizer's rows as
    the allowed ids when those are few (a small tokenizer on a large vocabulary, as the bench's
    random policies have); nothing when there are no such rows. Both act before temperature and
    the processed logprobs. Refuses, at start-up, a model where both are too many for vLLM."""
    if tokenizer_rows >= vocab_rows:
        return {}
    if vocab_rows - tokenizer_rows <= MAX_MASKED_IDS:
        return {"logit_bias": {token: float("-inf") for token in range(tokenizer_rows, vocab_rows)}}
    if tokenizer_rows <= MAX_MASKED_IDS:
        return {"allowed_token_ids": list(range(tokenizer_rows))}
    raise ValueError(
        f"{key}.model_path: '{model_path}' has {vocab_rows} vocabulary rows and its tokenizer "
        f"{tokenizer_rows} tokens; vLLM can keep at most {MAX_MASKED_IDS} ids out of (or in) its "
        f"samples, and here {vocab_rows - tokenizer_rows} rows would have to be left out: use a "
        f"tokenizer that covers the vocabulary, or {key}.engine=hf"
    )


def vllm_version() -> str:
    import vllm

    return vllm.__version__
