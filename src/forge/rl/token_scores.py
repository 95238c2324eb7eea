"""What a loss needs of the model at each target token, computed without the full logits.

A loss reads three numbers per target token: its logprob (differentiable), the entropy of the
distribution that scored it (differentiable on request: ``entropy_grad``, for an entropy bonus),
and whether it was the most likely token (for SFT's accuracy).
``scores_from_logits`` computes them from logits ``[B, T, V]``; ``head_scores`` computes
the same numbers from the last hidden states and the output projection, one chunk of rows at a
time, so that neither the logits nor their float32 copy ever exist for the whole batch: at a
152k vocabulary a micro-batch of 32k tokens would need 10 GB of bf16 logits and 20 GB more in
float32. Its backward recomputes each chunk's logits (one more matmul of the head) instead of
keeping them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from forge.rl.ops import check_logits, compute_entropy, compute_logprobs, float_dtype, row_chunks

# Float32 logit elements per chunk: 1 GiB on a GPU (a 152k vocabulary gives 1,766 rows, large
# enough for the head's matmul to run at full rate), 128 MiB elsewhere.
_CHUNK_ELEMENTS = {"cuda": 2**28}
_DEFAULT_CHUNK_ELEMENTS = 2**25


@dataclass
class TokenScores:
    """Per target token ``[B, T]``: ``logprobs`` (float32, differentiable), ``entropy`` (float32,
    differentiable when computed with ``entropy_grad``) and ``is_argmax`` (bool: the target has
    the highest logit)."""

    logprobs: Tensor
    entropy: Tensor
    is_argmax: Tensor

    @classmethod
    def unstack(cls, stacked: Tensor) -> TokenScores:
        """From ``head_scores``' ``[..., 3]`` tensor."""
        return cls(stacked[..., 0], stacked[..., 1], stacked[..., 2].detach() > 0)


def scores_from_logits(
    logits: Tensor, target_ids: Tensor, temperature: float = 1.0, entropy_grad: bool = False
) -> TokenScores:
    """The scores of ``target_ids`` under ``softmax(logits / temperature)`` (``logits[:, t]``
    scores ``target_ids[:, t]``); with ``entropy_grad`` the entropy carries a gradient (its graph
    keeps a softmax of the logits: only when a loss needs it)."""
    check_logits("scores_from_logits", logits, target_ids)
    target_ids = target_ids.long()
    logprobs = compute_logprobs(logits, target_ids, temperature)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = compute_entropy(logits, torch.ones_like(target_ids), temperature)[0]
    with torch.no_grad():
        detached = logits.detach()
        target_logits = detached.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
        is_argmax = target_logits >= detached.max(-1).values
    return TokenScores(logprobs, entropy, is_argmax)


def head_scores(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target_ids: Tensor,
    temperature: float = 1.0,
    entropy_grad: bool = False,
) -> Tensor:
    """The scores of ``target_ids`` ``[B, T]`` under ``softmax((hidden @ weight.T + bias) / temperature)``,
    stacked ``[B, T, 3]`` (one tensor, so that module hooks see it; ``TokenScores.unstack`` reads it).

    ``hidden`` ``[B, T, D]`` and ``weight`` ``[V, D]`` are multiplied in the autocast dtype when
    autocast is on (as ``nn.Linear`` would be), else in ``hidden``'s dtype; the softmax runs in
    float32. Gradients reach ``hidden``, ``weight`` and ``bias`` through the logprobs, and with
    ``entropy_grad`` through the entropy too.
    """
    if hidden.shape[:-1] != target_ids.shape:
        raise ValueError(
            f"head_scores: hidden must be [B, T, D] and target_ids [B, T], "
            f"got {tuple(hidden.shape)} and {tuple(target_ids.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"head_scores: temperature must be > 0, got {temperature}")
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    return _FusedHeadScores.apply(hidden, weight, bias, target_ids.long(), temperature, dtype, entropy_grad)


def _row_chunks(rows: int, vocab: int, device: torch.device):
    return row_chunks(rows, vocab, _CHUNK_ELEMENTS.get(device.type, _DEFAULT_CHUNK_ELEMENTS))


class _FusedHeadScores(torch.autograd.Function):
    """``[B, T, 3]``: logprob, entropy and is-argmax (1.0 or 0.0) of each target; the logprob
    channel carries a gradient, and the entropy channel with ``entropy_grad``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target_ids, temperature, dtype, entropy_grad):
        flat_hidden = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
        cast_weight = weight.to(dtype)
        cast_bias = None if bias is None else bias.to(dtype)
        flat_targets = target_ids.reshape(-1)
        rows = flat_hidden.shape[0]
        out = torch.empty(rows, 3, dtype=torch.float32, device=hidden.device)
        log_normaliser = torch.empty(rows, dtype=float_dtype(dtype), device=hidden.device)
        chunk_scores = _kernel(_chunk_scores, hidden.device)
        for chunk in _row_chunks(rows, weight.shape[0], hidden.device):
            out[chunk], log_normaliser[chunk] = chunk_scores(
                flat_hidden[chunk], cast_weight, cast_bias, flat_targets[chunk], temperature
            )
        ctx.save_for_backward(flat_hidden, cast_weight, cast_bias, flat_targets, log_normaliser)
        ctx.temperature, ctx.entropy_grad = temperature, entropy_grad
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out.view(*target_ids.shape, 3)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        flat_hidden, weight, bias, flat_targets, log_normaliser = ctx.saved_tensors
        hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes
        grad_logprobs = grad_out.reshape(-1, 3)[:, 0].to(log_normaliser.dtype)
        grad_entropy = grad_out.reshape(-1, 3)[:, 1].to(log_normaliser.dtype) if ctx.entropy_grad else None
        grad_hidden = torch.empty_like(flat_hidden)
        # Summed over chunks in float32 (or float64), cast to the parameters' dtype once.
        accumulate = log_normaliser.dtype
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device)
        grad_bias = None if bias is None else torch.zeros(bias.shape, dtype=accumulate, device=bias.device)
        chunk_grad_logits = _kernel(_chunk_grad_logits, flat_hidden.device)
        for chunk in _row_chunks(flat_hidden.shape[0], weight.shape[0], flat_hidden.device):
            grad_logits = chunk_grad_logits(
                flat_hidden[chunk],
                weight,
                bias,
                flat_targets[chunk],
                log_normaliser[chunk],
                grad_logprobs[chunk],
                None if grad_entropy is None else grad_entropy[chunk],
                ctx.temperature,
            )
            grad_hidden[chunk] = grad_logits @ weight
            _accumulate_product(grad_weight, grad_logits.T, flat_hidden[chunk])
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0, dtype=accumulate)
        return (
            grad_hidden.view(grad_out.shape[:-1] + (flat_hidden.shape[-1],)).to(hidden_dtype),
            grad_weight.to(weight_dtype),
            None if grad_bias is None else grad_bias.to(bias_dtype),
            None,
            None,
            None,
            None,
        )


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    logits = hidden @ weight.T if bias is None else torch.addmm(bias, hidden, weight.T)
    return logits.to(float_dtype(logits.dtype)) / temperature


def _chunk_scores(hidden, weight, bias, targets, temperature) -> tuple[Tensor, Tensor]:
    """``[rows, 3]`` scores of one chunk of rows, and the rows' log-normalisers."""
    scaled = _chunk_logits(hidden, weight, bias, temperature)
    lse = scaled.logsumexp(-1)
    target = scaled.gather(-1, targets[:, None]).squeeze(-1)
    entropy = lse - ((scaled - lse[:, None]).exp() * scaled).sum(-1)
    is_argmax = (target >= scaled.amax(-1)).to(scaled.dtype)
    return torch.stack([target - lse, entropy, is_argmax], dim=-1).float(), lse


def _chunk_grad_logits(hidden, weight, bias, targets, lse, grad, grad_entropy, temperature) -> Tensor:
    """d loss / d logits of one chunk, in the weight's dtype: ``d logp[target] / d logits =
    (onehot(target) - p) / T`` times the upstream gradient, with ``p = softmax(logits / T)``;
    with ``grad_entropy`` (None: the entropy has no gradient), plus ``d H / d logits =
    -p (log p + H) / T`` times its own."""
    scaled = _chunk_logits(hidden, weight, bias, temperature)
    is_target = torch.arange(scaled.shape[-1], device=scaled.device) == targets[:, None]
    log_probs = scaled - lse[:, None]
    probs = log_probs.exp()
    grad_logits = (is_target.to(scaled.dtype) - probs) * (grad / temperature)[:, None]
    if grad_entropy is not None:
        entropy = -(probs * log_probs).sum(-1, keepdim=True)
        grad_logits = grad_logits - probs * (log_probs + entropy) * (grad_entropy / temperature)[:, None]
    return grad_logits.to(weight.dtype)


def _accumulate_product(out: Tensor, a: Tensor, b: Tensor) -> None:
    """``out += a @ b`` with ``out`` in a wider dtype than ``a`` and ``b``: one GEMM that
    accumulates in ``out``'s dtype on a GPU (no low-precision product to add)."""
    if out.is_cuda and a.dtype != out.dtype:
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:
        out += (a @ b).to(out.dtype)


_COMPILED: dict = {}


def _kernel(fn, device: torch.device):
    """``fn`` compiled on a GPU, where inductor fuses the chunk's softmax passes into a few
    reads of the matmul's output (eager, they are a dozen passes over float32 copies and took
    more GPU time than the whole model); as it is elsewhere."""
    if device.type != "cuda":
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]
