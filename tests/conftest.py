"""Shared pytest set-up. Tests are imported with importlib mode (see pyproject.toml)."""

import os
import sys

import pytest

# Monarch reads these at import: keep child processes quiet and single-threaded so that
# several meshes fit on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module", autouse=True)
def _own_process_group():
    """A module that builds an engine in this process creates a world-size-1 process group (vLLM
    keeps its own groups around it); drop both for the next module, whose in-process engines
    make their own. A torch group dropped under vLLM's would leave vLLM's next start holding a
    destroyed group ("not initialized in the world group map")."""
    yield
    import torch.distributed as dist

    vllm_groups = sys.modules.get("vllm.distributed.parallel_state")
    if vllm_groups is not None:
        vllm_groups.destroy_model_parallel()
        vllm_groups.destroy_distributed_environment()
    if dist.is_initialized():
        dist.destroy_process_group()
