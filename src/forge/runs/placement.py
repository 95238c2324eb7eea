"""A GRPO run's GPU placement: its config as a request to the planner (`forge.controller.gpu_plan`),
made before any process starts (a refusal names the keys) and printed at start-up, with what each
generator replica's KV cache holds against the samples the rollouts give it, and the replicas that
no rollout would keep busy or that would wait for the trainer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from forge.controller.gpu_plan import GpuPlan, Machine, PlacementRequest, plan_gpus
from forge.engines.vllm_config import VLLMConfig, kv_cache_gib
from forge.grpo.config import GRPOConfig


def policy_settings(model_cfg) -> dict[str, Any]:
    """The trainer's model (`trainer.engine.model`) as config.json would describe it."""
    from forge.engines.titan.checkpoint_model import model_settings, read_checkpoint_model
    from forge.engines.titan.flavors import resolve_model_args

    if model_cfg.hf_path is not None:
        return read_checkpoint_model(model_cfg.hf_path).settings
    return model_settings(resolve_model_args(model_cfg.name, model_cfg.flavor, model_cfg.vocab_size))


def trainer_state_gib(cfg: GRPOConfig, settings: dict[str, Any]) -> float:
    """Per trainer GPU: the policy's weights, gradients and two AdamW moments in the training
    dtype, the weights of the reference model and of a teacher beside the trainer where there are any,
    and the critic's weights, gradients and moments where there is one (they share the trainer's
    GPUs), over the FSDP shards; with LoRA, the frozen weights once (in their dtype) and the
    adapters' four copies, the reference being the trainer's own model. A floor: activations
    come on top."""
    from forge.engines.titan.checkpoint_model import (
        lora_parameter_count,
        parameter_count,
        read_checkpoint_model,
    )

    engine = cfg.trainer.engine
    ranks = cfg.trainer.procs * cfg.trainer.hosts
    shards = max(ranks // engine.parallelism.data_parallel_replicate_degree, 1)
    itemsize = getattr(torch, engine.training.dtype).itemsize
    if engine.lora is not None:
        frozen = parameter_count(settings) * getattr(torch, engine.training.frozen_dtype).itemsize
        adapters = lora_parameter_count(settings, engine.lora.targets(), engine.lora.rank)
        state = frozen + adapters * itemsize * 4
    else:
        state = parameter_count(settings) * itemsize * (4 + (1 if cfg.reference_actor else 0))
    if cfg.distill is not None and cfg.distill.gpu == "trainer":
        state += parameter_count(read_checkpoint_model(cfg.distill.teacher_path).settings) * itemsize
    if cfg.critic is not None:
        critic = settings if cfg.critic.path is None else read_checkpoint_model(cfg.critic.path).settings
        state += parameter_count(critic) * 4 * itemsize
    return state / shards / 2**30


# vLLM's memory beside its weights and a fixed KV cache: CUDA graphs, the profile run's
# activations, the sampler's buffers and the CUDA context. Measured on an H100 at 8B: the
# replica's process held 43.15 GiB with 15.26 of weights, 15.26 of receive buffers and an 8 GiB
# KV cache (bench/RESULTS.md, issue 28, fifteenth session).
VLLM_RUNTIME_GIB = 4.6


def weight_copies_gib(cfg: GRPOConfig, settings: dict[str, Any]) -> tuple[float, float, float | None]:
    """The copies of the policy's weights in the generator's dtype that the weight sync and vLLM
    hold, in GiB: per trainer GPU (its publish slots), per replica (its receive buffers on its
    GPU), and per GPU of a replica for vLLM when its KV cache has a fixed size (else None).
    With LoRA only adapters travel, and they are left out."""
    from forge.engines.titan.checkpoint_model import parameter_count
    from forge.weight_transports import IpcTransport

    weights = parameter_count(settings) * getattr(torch, cfg.generator.dtype).itemsize / 2**30
    vllm = cfg.generator.vllm
    kv = vllm.kv_cache_memory_gib
    in_vllm = None if kv is None else weights / vllm.tensor_parallel_size + kv + VLLM_RUNTIME_GIB
    if cfg.trainer.engine.lora is not None:
        return 0.0, 0.0, in_vllm
    transport = cfg.generator.weight_transport
    ranks = cfg.trainer.procs * cfg.trainer.hosts
    # Each rank stages its own rows (`auto` is CUDA IPC on one host of GPUs); the store keeps
    # versions in host memory.
    slots = {"auto": IpcTransport.SLOTS, "cuda_ipc": IpcTransport.SLOTS, "broadcast": 1}.get(transport, 0)
    # With TP the receive buffers are host memory the workers map (forge.engines.vllm_weights);
    # a broadcast receiver also keeps the newest version it received on its GPU.
    receive = (weights if vllm.tensor_parallel_size == 1 else 0.0) + (
        weights if transport == "broadcast" else 0.0
    )
    return slots * weights / ranks, receive, in_vllm


def kv_cache_tokens(model: dict[str, Any], vllm: VLLMConfig, dtype: str, gib: float) -> int:
    """The tokens a KV cache of `gib` GiB on each GPU of a replica holds for `model` (its
    config.json): a key and a value per layer and key/value head, in the generator's dtype,
    with vLLM's tensor parallelism splitting the heads (or replicating them when they are fewer)."""
    heads = max(model.get("num_key_value_heads") or model["num_attention_heads"], 1)
    head_dim = model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]
    heads_here = max(heads // vllm.tensor_parallel_size, 1)
    per_token = 2 * model["num_hidden_layers"] * heads_here * head_dim * getattr(torch, dtype).itemsize
    return int(gib * 2**30) // per_token


@dataclass(frozen=True)
class ReplicaKVCache:
    """One generator replica's vLLM KV cache: its size on each GPU, the tokens it holds, and
    the longest sample vLLM admits (`max_model_len`, else the model's)."""

    gib: float
    tokens: int
    max_model_len: int


def replica_kv_cache(cfg: GRPOConfig, on_gpu: bool) -> ReplicaKVCache | None:
    """None when vLLM sizes its cache at start-up (on a GPU without
    generator.vllm.kv_cache_memory_gib), the hf engine generates, or the model's config.json
    gives no length."""
    from forge.actors.generator import resolve_engine
    from forge.engines.titan.checkpoint_model import read_config_json

    vllm = cfg.generator.vllm
    gib = kv_cache_gib(vllm, on_gpu)
    if resolve_engine(cfg.generator.engine) != "vllm" or gib is None:
        return None
    model = read_config_json(cfg.generator.model_path)
    longest = vllm.max_model_len or model_max_len(model)
    if longest is None:  # vLLM finds the model's length elsewhere
        return None
    return ReplicaKVCache(gib, kv_cache_tokens(model, vllm, cfg.generator.dtype, gib), longest)


# Where a config.json may give the model's context length; vLLM takes the shortest it finds
# (then may lengthen it by the RoPE scaling factor), so this is never longer than vLLM's.
_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)


def model_max_len(model: dict[str, Any]) -> int | None:
    """The context length vLLM admits for `model` (its config.json) without `max_model_len`, or
    less; None when the file gives none."""
    lengths = [model[key] for key in _LENGTH_KEYS if isinstance(model.get(key), int)]
    return min(lengths) if lengths else None


def check_kv_cache(cfg: GRPOConfig, on_gpu: bool) -> None:
    """Refuses, before any process starts, a KV cache that cannot hold one sample of the longest
    length vLLM admits: vLLM would refuse to start, in the generator's process."""
    cache = replica_kv_cache(cfg, on_gpu)
    if cache is None or cache.tokens >= cache.max_model_len:
        return
    raise ValueError(
        f"generator.vllm.kv_cache_memory_gib {cache.gib:g} holds {cache.tokens:,} tokens of "
        f"{cfg.generator.model_path}, fewer than one sample of max_model_len {cache.max_model_len:,} "
        "(generator.vllm.max_model_len, else the length the model's config.json gives), which vLLM refuses: "
        f"raise kv_cache_memory_gib to {round_up(cache.gib * cache.max_model_len / cache.tokens)}, or set "
        f"generator.vllm.max_model_len to at most {cache.tokens:,}"
    )


def bound_rollouts(cfg: GRPOConfig) -> int:
    """The rollouts the staleness bound lets be made ahead of training (`forge.staleness`:
    max_policy_age + 1 batches, each rollout reserving prompts_per_step x group_size episodes)."""
    ahead = (cfg.replay_buffer.max_policy_age + 1) * cfg.replay_buffer.batch_size
    return -(-ahead // cfg.rollout.samples)


def rollouts_at_once(cfg: GRPOConfig) -> int:
    """The most rollouts that run at once: one a rollout thread, and no more than the staleness
    bound lets be made ahead of training (`bound_rollouts`)."""
    return min(cfg.rollout.threads, bound_rollouts(cfg))


def samples_given_per_replica(cfg: GRPOConfig) -> int:
    """The most samples the rollouts give one generator replica at once: each rollout's prompts x
    group_size, the rollouts that run at once spread over the replicas."""
    return -(-rollouts_at_once(cfg) // cfg.generator.replicas) * cfg.rollout.samples


def idle_replicas_line(cfg: GRPOConfig, on_gpu: bool) -> str | None:
    """A line for the start of the run when generator replicas will idle, None otherwise (a
    rollout runs on one replica):
    - fewer rollouts run at once than there are replicas: the others never get one;
    - the staleness bound lets exactly one rollout a replica be made ahead of training: a replica
      whose rollout ends must wait for the trainer to train a batch and publish the weights before
      it may start its next (`forge.staleness`: the slot frees when a step has trained, and the
      rollout then needs the version just published). One rollout of slack lets it start at once.
      (The 4-GPU rows of bench/RESULTS.md's twentieth session, issue 28, ran so: max_policy_age 3
      over 4 replicas of whole rollouts. At the `trl` preset the slack gained nothing there, the
      twenty-first session: the replicas idled as much.) Not named: on-policy runs (max_policy_age
      0), which wait so by design, and where generation and training take turns on one device
      anyway: on CPU, and one replica beside the trainer (provisioner.colocate) on a GPU."""
    rollout, buffer, replicas = cfg.rollout, cfg.replay_buffer, cfg.generator.replicas
    running = rollouts_at_once(cfg)
    ahead = (
        f"replay_buffer.max_policy_age {buffer.max_policy_age} lets {buffer.max_policy_age + 1} x batch_size "
        f"{buffer.batch_size} episodes be made ahead of training, rollouts of prompts_per_step "
        f"{rollout.prompts_per_step} x group_size {rollout.group_size}"
    )
    if running < replicas:
        return (
            f"generator replicas idle: {running} rollout(s) run at once and each runs on one of the "
            f"{replicas} generator.replicas (rollout.threads {rollout.threads}; {ahead}): raise "
            "rollout.threads or max_policy_age, or lower rollout.prompts_per_step, to give each replica one"
        )
    shares_the_trainers_device = not on_gpu or (replicas == 1 and cfg.provisioner.colocate)
    if buffer.max_policy_age == 0 or shares_the_trainers_device or bound_rollouts(cfg) > replicas:
        return None
    # The least age whose bound exceeds the replicas' rollouts: (age + 1) x batch_size > replicas x samples.
    slack = replicas * rollout.samples // buffer.batch_size
    return (
        f"generator replicas wait for the trainer: {ahead}, so {replicas} rollouts at once, one for each "
        f"of the {replicas} generator.replicas and none more. A replica whose rollout ends starts its "
        "next only once the trainer has trained a batch and published the weights; "
        f"replay_buffer.max_policy_age {slack} lets it start at once (its episodes then up to {slack} "
        "versions old)"
    )


def kv_cache_line(cfg: GRPOConfig, on_gpu: bool) -> str | None:
    """What one replica's vLLM KV cache holds against the samples the rollouts may give it at
    once, as a line for the start of the run (None as `replica_kv_cache`). Past what its
    cache holds, vLLM preempts samples and recomputes their caches as others end, so a replica
    runs fewer samples at once than the run gives it: every `long` row of the bench at 1.7B ran
    16 GiB caches of 137 samples against up to 640 (bench/RESULTS.md, issue 28)."""
    cache = replica_kv_cache(cfg, on_gpu)
    if cache is None:
        return None
    # A sample's prompt and response fit the trainer's sequence (the start-up checks see to it).
    longest = min(cache.max_model_len, cfg.trainer.engine.training.seq_len)
    holds = cache.tokens // longest
    rollout, replicas, tp = cfg.rollout, cfg.generator.replicas, cfg.generator.vllm.tensor_parallel_size
    asked = samples_given_per_replica(cfg)
    size = f"{cache.gib:g} GiB" + (f" on each of its {tp} GPUs" if tp > 1 else "")
    line = (
        f"generator KV cache: a replica holds {cache.tokens:,} tokens ({size}), {holds:,} samples of "
        f"{longest:,} (trainer.engine.training.seq_len, or generator.vllm.max_model_len if shorter); "
        f"the rollout gives a replica up to {asked:,} samples at once ({rollouts_at_once(cfg)} "
        f"rollouts at once (rollout.threads {rollout.threads}, as replay_buffer.max_policy_age allows) "
        f"over generator.replicas {replicas}, x prompts_per_step {rollout.prompts_per_step} x group_size "
        f"{rollout.group_size})"
    )
    if cfg.generator.update_mode == "drain" and asked > rollout.samples:
        # forge.staleness: with the trainer ahead, the rollout that starts after the others needs
        # the policy of the step just trained; under drain its replica first waits for every
        # running sample to end (bench/RESULTS.md, issue 28, nineteenth session).
        line += (
            f". With generator.update_mode=drain, once the trainer outpaces the generators a replica runs "
            f"one rollout at a time ({rollout.samples:,} samples): each new rollout then needs the newest "
            "policy, which a replica loads only after its running samples end; larger rollouts "
            "(rollout.prompts_per_step) or update_mode=in_flight run more at once"
        )
    if asked <= holds:
        return line
    needed = round_up(cache.gib * asked * longest / cache.tokens)
    return (
        f"{line}. Past {holds:,}, vLLM preempts samples and recomputes their caches as others end: "
        f"to run them all at once, raise generator.vllm.kv_cache_memory_gib to {needed} where the "
        "GPU has room, or lower rollout.threads"
    )


def round_up(gib: float) -> str:
    """`gib` rounded up to three significant digits: a size that is enough."""
    exponent = math.floor(math.log10(gib)) - 2
    return f"{math.ceil(gib / 10**exponent) * 10**exponent:.3g}"


def placement_request(cfg: GRPOConfig, settings: dict[str, Any]) -> PlacementRequest:
    vllm = cfg.generator.engine != "hf"
    trainer_buffers, generator_buffers, in_vllm = weight_copies_gib(cfg, settings)
    own = {f"reward model {m.name}": m.replicas for m in cfg.reward.models if m.gpu == "own"}
    if cfg.distill is not None and cfg.distill.gpu == "own":
        own["teacher"] = cfg.distill.procs
    return PlacementRequest(
        trainer_procs=cfg.trainer.procs if cfg.trainer.enabled else 0,
        generator_replicas=cfg.generator.replicas,
        colocate=cfg.provisioner.colocate,
        generator_tp=cfg.generator.vllm.tensor_parallel_size,
        generator_replicas_per_gpu=cfg.generator.replicas_per_gpu,
        generator_share=cfg.generator.vllm.gpu_memory_utilization if vllm else 0.0,
        trainer_gib=trainer_state_gib(cfg, settings) if cfg.trainer.enabled else None,
        trainer_buffers_gib=trainer_buffers if cfg.trainer.enabled else 0.0,
        generator_gib=in_vllm if vllm else None,
        generator_buffers_gib=generator_buffers,
        attention_heads=(settings["num_attention_heads"], settings["num_key_value_heads"]),
        own_gpus=own,
        weight_broadcast=cfg.generator.weight_transport == "broadcast",
    )


def grpo_gpu_plan(cfg: GRPOConfig, visible: list[str]) -> GpuPlan | None:
    """The plan for a GRPO run on the `visible` GPUs of this host; None without GPUs, or with
    worker hosts (`provisioner.hosts`), where GPUs are handed out per host as meshes start."""
    if not visible or cfg.provisioner.hosts:
        return None
    return plan_gpus(
        placement_request(cfg, policy_settings(cfg.trainer.engine.model)), Machine.detect(visible)
    )
