"""The per-process metric collector behind `record_metric`."""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING

from forge.observability.reduce import Accumulator, Reduce

if TYPE_CHECKING:
    import torch

_lock = threading.Lock()
_state: dict[str, Accumulator] = {}


def record_metric(key: str, value: float | int | torch.Tensor, reduce: Reduce = Reduce.MEAN) -> None:
    """Records one value of metric `key` (named `component/name`) in this process.

    Safe to call from any actor or the controller; values are reduced exactly across all
    processes when the metric logger flushes.
    """
    # torch is imported by whoever made a tensor: an actor process that needs no torch never
    # imports it (a second of CPU at start-up).
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        value = value.detach().float().item()
    with _lock:
        acc = _state.get(key)
        if acc is None:
            acc = _state[key] = Accumulator(reduce)
        elif acc.reduce is not reduce:
            raise ValueError(
                f"metric '{key}' was recorded with {acc.reduce.name} and now with {reduce.name}; "
                "use one reduction per key"
            )
        acc.add(float(value))


def pop_state() -> dict[str, Accumulator]:
    """Returns what this process recorded since the last call, and starts afresh."""
    global _state
    with _lock:
        state, _state = _state, {}
    return state
