"""Device and process group for the engine: CUDA with NCCL when there is a GPU, else CPU with gloo."""

import logging
import os

import torch
import torch.distributed as dist
import torchtitan.distributed.parallel_dims
import torchtitan.distributed.utils
import torchtitan.tools.utils

logger = logging.getLogger(__name__)


def init_runtime() -> torch.device:
    """Point torchtitan at our device and make sure a default process group exists.

    A process group already created by the caller (e.g. a launcher) is used as is. Otherwise
    the engine reads the usual env variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) when
    RANK is set, or creates a private group of world size 1.
    """
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    _point_torchtitan_at(device_type)
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        logger.info("created a %s process group of world size %d", backend, dist.get_world_size())
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _point_torchtitan_at(device_type: str) -> None:
    # torchtitan picks "cuda" at import time even without a GPU, and two of its modules copied
    # the value with `from ... import device_type`: every copy must change.
    device_module = getattr(torch, device_type)
    torchtitan.tools.utils.device_type = device_type
    torchtitan.tools.utils.device_module = device_module
    torchtitan.distributed.utils.device_type = device_type
    torchtitan.distributed.utils.device_module = device_module
    torchtitan.distributed.parallel_dims.device_type = device_type
