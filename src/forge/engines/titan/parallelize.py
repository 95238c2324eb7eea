"""Parallel dimensions and the train spec's parallelisms, with two fixes torchtitan 0.2.2 needs.

1. Tied embeddings under FSDP. torchtitan shards ``tok_embeddings`` and ``[norm, output]`` in
   two FSDP groups; with tied weights (qwen3 0.6B/1.7B/4B and our tiny flavors) both groups then
   hold the same parameter, which torch 2.13 rejects at the first forward ("Parameter ... is
   shared with a parameter already managed by another FSDP group"). Fixed upstream after 0.2.2
   (torchtitan PR #2522) the way we do it here: one group for embeddings, norm and output.
2. FSDP on gloo. torchtitan turns off FSDP's gradient division (it scales the loss instead),
   after which FSDP reduce-scatters with ``ReduceOp.PREMUL_SUM``, which gloo lacks ("Cannot use
   ReduceOp.PREMUL_SUM with Gloo"). Forcing a plain SUM gives the same gradients.
"""

import copy
import logging

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torchtitan.config import TORCH_DTYPE_MAP, JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.models.llama3.infra.parallelize import disable_fsdp_gradient_division
from torchtitan.protocols.train_spec import TrainSpec

from forge.engines.titan.config import ParallelismConfig

logger = logging.getLogger(__name__)


def parallelize(
    model: nn.Module, spec: TrainSpec, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    """Tensor parallel, activation checkpointing, compile and data parallel, as the spec does them."""
    if parallel_dims.fsdp_enabled and getattr(model, "enable_weight_tying", False):
        _parallelize_tied(model, spec, parallel_dims, job_config)
    else:
        model = spec.parallelize_fn(model, parallel_dims, job_config)
    if parallel_dims.fsdp_enabled and dist.get_backend() == "gloo":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return model


def _parallelize_tied(
    model: nn.Module, spec: TrainSpec, parallel_dims: ParallelDims, job_config: JobConfig
) -> None:
    # Let the spec apply everything but data parallelism: a view of the same meshes whose data
    # parallel degrees read 1. The meshes must exist before the copy so that both share them
    # (the property builds them once).
    _ = parallel_dims.world_mesh
    without_dp = copy.copy(parallel_dims)
    without_dp.dp_shard = 1
    without_dp.dp_replicate = 1
    spec.parallelize_fn(model, without_dp, job_config)

    # The dense-model part of torchtitan's apply_fsdp, with the tied modules in one group.
    mesh_names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    training = job_config.training
    fsdp_kwargs = {
        "mesh": parallel_dims.get_mesh(mesh_names),
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        ),
    }
    reshard_after_forward = job_config.parallelism.fsdp_reshard_after_forward != "never"
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=reshard_after_forward, **fsdp_kwargs)
    fully_shard(
        [model.tok_embeddings, model.norm, model.output],
        reshard_after_forward=job_config.parallelism.fsdp_reshard_after_forward == "always",
        **fsdp_kwargs,
    )
    fully_shard(model, **fsdp_kwargs)
    disable_fsdp_gradient_division(model)
    logger.info("applied FSDP with the tied embedding and output in one group")


def build_parallel_dims(par: ParallelismConfig) -> ParallelDims:
    """torchtitan's ParallelDims for this world size; no pipeline, context or expert parallelism."""
    world_size = dist.get_world_size()
    return ParallelDims(
        dp_replicate=par.data_parallel_replicate_degree,
        dp_shard=par.dp_degree(world_size) // par.data_parallel_replicate_degree,
        cp=1,
        tp=par.tensor_parallel_degree,
        pp=1,
        ep=1,
        etp=1,
        world_size=world_size,
    )
