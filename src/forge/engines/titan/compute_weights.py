"""The weights in the compute dtype, cast once per train step, on a trainer without FSDP.

With FSDP, its mixed-precision policy casts each float32 weight to the compute dtype when it
gathers it. Without FSDP, autocast would cast every weight at every use instead: in each
micro-batch's forward, and the cast's backward again in each backward. Here the modules hold
compute-dtype copies of their float32 (master) parameters for the length of a step, made once.
Each micro-batch's gradient of a copy is added to its master's float32 gradient as soon as
autograd has accumulated it, so micro-batches sum in float32 as they do under FSDP. The masters
are back in the modules when the step's backward passes are done: clipping, the optimizer,
checkpoints and weight publishing see the float32 parameters only.

Compute then runs in that dtype throughout (no autocast), as it does under FSDP's policy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class ComputeWeights:
    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.model = model
        self.dtype = dtype

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """While active, every parameter slot of the model holds the compute-dtype copy of its
        master (a weight shared by two modules, like tied embeddings, stays shared)."""
        slots = [
            (module, name, param)
            for module in self.model.modules()
            for name, param in module._parameters.items()
            if param is not None
        ]
        copies: dict[int, nn.Parameter] = {}
        for module, name, master in slots:
            if id(master) not in copies:
                copies[id(master)] = self._copy_of(master)
            module._parameters[name] = copies[id(master)]
        try:
            yield
        finally:
            for module, name, master in slots:
                module._parameters[name] = master

    def _copy_of(self, master: nn.Parameter) -> nn.Parameter:
        with torch.no_grad():
            copy = nn.Parameter(master.to(self.dtype), requires_grad=master.requires_grad)
        if master.requires_grad and torch.is_grad_enabled():
            copy.register_post_accumulate_grad_hook(lambda c: _add_to_master(master, c))
        return copy


def _add_to_master(master: nn.Parameter, copy: nn.Parameter) -> None:
    with torch.no_grad():
        if master.grad is None:
            master.grad = copy.grad.to(master.dtype)
        else:
            master.grad.add_(copy.grad)
    copy.grad = None
