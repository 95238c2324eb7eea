"""A GRPO run's GPU placement: its config as a request to the planner (`forge.controller.gpu_plan`),
made before any process starts (a refusal names the keys) and printed at start-up."""

from __future__ import annotations

from typing import Any

import torch

from forge.controller.gpu_plan import GpuPlan, Machine, PlacementRequest, plan_gpus
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


def placement_request(cfg: GRPOConfig, settings: dict[str, Any]) -> PlacementRequest:
    vllm = cfg.generator.engine != "hf"
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
