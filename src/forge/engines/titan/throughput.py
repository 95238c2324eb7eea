"""How fast a train step ran: the time of its phases and its model FLOPs utilisation (MFU).

Model FLOPs of a step (forward and backward, recomputation not counted, as in the PaLM paper's
MFU): for each sequence of ``L`` tokens,

    6 * P * L  +  6 * layers * heads * head_dim * L**2

where ``P`` is the number of weights in matrix multiplications (every linear layer, the output
projection included even when it shares the embedding's weights; the embedding lookup is
free), and the second term is causal attention (``Q K^T`` and ``P V``, each ``2 * L**2 * heads *
head_dim`` over the full square, half of it causal, times 3 for forward and backward). Only the
sequences' own tokens count: padding is not useful work. MFU is those FLOPs over the step's time
and the GPUs' dense bf16 peak.
"""

import contextlib
import time
from collections.abc import Iterator

import torch
import torch.distributed
from torch import nn

# Dense bf16 tensor-core peak per GPU (datasheet, without sparsity), matched against the device name.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "B200": 2250e12}


def peak_flops(device: torch.device) -> float | None:
    """The device's bf16 peak, or None where it is not known (a CPU, an unlisted GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


class ModelFlops:
    """Counts a model's training FLOPs per sequence; built from the model before it is parallelized."""

    def __init__(self, model: nn.Module, layers: int, heads: int, head_dim: int) -> None:
        self.matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
        self.attention_factor = 6 * layers * heads * head_dim

    def of_sequences(self, lengths: torch.Tensor) -> float:
        lengths = lengths.to(torch.float64)
        return float(6 * self.matmul_weights * lengths.sum() + self.attention_factor * (lengths**2).sum())


class PhaseTimer:
    """Sums the time spent in named phases of a step. On a GPU it records CUDA events (no
    synchronisation until ``seconds``, which the step's own final sync precedes)."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._spans: dict[str, list] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start, end = (
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            if self._cuda
            else (None, None)
        )
        started = time.perf_counter()
        if self._cuda:
            start.record()
        yield
        if self._cuda:
            end.record()
            self._spans.setdefault(name, []).append((start, end))
        else:
            self._spans.setdefault(name, []).append(time.perf_counter() - started)

    def seconds(self) -> dict[str, float]:
        if self._cuda:
            torch.cuda.synchronize()
            return {
                name: sum(s.elapsed_time(e) for s, e in spans) / 1e3 for name, spans in self._spans.items()
            }
        return {name: sum(spans) for name, spans in self._spans.items()}


def step_throughput(
    counts: dict[str, float], phases: dict[str, float], seconds: float, peak: float | None
) -> dict[str, float]:
    """A step's ``trainer/*`` metrics from its ``counts`` over every rank (``sequence_tokens``,
    ``computed_tokens``, ``flops``), its phase times and its wall time; MFU where ``peak`` (one
    GPU's) is known, over every GPU of the process group."""
    out = {f"trainer/{name}_s": value for name, value in phases.items()}
    out["trainer/step_s"] = seconds
    out["trainer/tokens_per_s"] = counts["sequence_tokens"] / seconds
    computed = counts["computed_tokens"]
    out["trainer/padding_frac"] = 1 - counts["sequence_tokens"] / computed if computed else 0.0
    if peak is not None:
        out["trainer/mfu"] = counts["flops"] / (seconds * peak * torch.distributed.get_world_size())
    return out
