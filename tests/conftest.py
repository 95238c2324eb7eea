"""Shared pytest set-up. Tests are imported with importlib mode (see pyproject.toml)."""

import gc
import os
import sys

import pytest
from processes import note_test_start

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


# vLLM freezes the heap when an engine starts and unfreezes all of it when the engine stops,
# after which collections walk the whole heap again (about 20 s over tests/engines). In this
# process the heap is frozen by the hook below instead: vLLM's calls do nothing.
_freeze, _unfreeze = gc.freeze, gc.unfreeze
gc.freeze = gc.unfreeze = lambda: None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before each test: collect the garbage, then freeze what is left (`gc.freeze`).

    This process holds every module the suite imports (vLLM, transformers, torch, Monarch...):
    some 800,000 objects, which each full collection walks, about 0.6 s each time. Frozen, the
    long-lived ones are left out of later collections, which then walk only what the running
    test made. No garbage is frozen (it is collected first); an object alive when a test starts
    and dropped later (a module's fixture) stays until the session ends (the fast suite's peak
    memory is the same as without the freezes)."""
    gc.collect()
    _freeze()
    note_test_start()


def pytest_sessionfinish(session, exitstatus):
    _unfreeze()  # exit collects everything, as without the freezes
