"""Token-level primitives that every loss is built from: logprobs, entropy, ratios, KL, clipping, aggregation.

Shapes: ``logits [B, T, V]``, ``target_ids [B, T]``, ``loss_mask [B, T]`` (non-zero on response
tokens, zero on prompt and padding), per-token values ``[B, T]``.

``logits[:, t]`` is the distribution that scores ``target_ids[:, t]``: callers do the shift
(for a causal LM, ``logits = model(tokens)[:, :-1]`` and ``target_ids = tokens[:, 1:]``).

Positions where ``loss_mask`` is zero may hold anything (padding logprobs of ``-inf`` or NaN
included): every op that takes a mask replaces them before they can reach a sum or a gradient.
"""

from collections.abc import Iterator
from typing import Literal

import torch
from torch import Tensor

AggMode = Literal["token_mean", "sequence_mean", "sequence_sum", "fixed_horizon"]
KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
RatioLevel = Literal["token", "sequence"]

# Float32 elements per chunk when eager code upcasts bf16 logits (128 MiB): large enough that
# the Python loop is short, small enough that the upcast copy stays far below the logits.
_CHUNK_ELEMENTS = 2**25


def check_same_shape(where: str, **tensors: Tensor) -> None:
    """Raise ValueError naming every tensor's shape unless all shapes are equal."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"{where}: shapes must match, got {listed}")


def check_logits(where: str, logits: Tensor, other: Tensor, other_name: str = "target_ids") -> None:
    """Raise ValueError unless ``logits`` is ``[B, T, V]`` and ``other`` is ``[B, T]``."""
    if logits.dim() != 3 or logits.shape[:2] != other.shape:
        raise ValueError(
            f"{where}: logits must be [B, T, V] and {other_name} [B, T], "
            f"got logits {tuple(logits.shape)}, {other_name} {tuple(other.shape)}"
        )


def broadcast_advantages(advantages: Tensor, shape: torch.Size) -> Tensor:
    """Return ``advantages`` (``[B]`` per sequence or ``[B, T]`` per token) as ``[B, T]``."""
    if advantages.dim() == 1 and advantages.shape[0] == shape[0]:
        return advantages[:, None].expand(shape)
    if advantages.shape == shape:
        return advantages
    raise ValueError(
        f"advantages must be [B] or [B, T] with [B, T] = {tuple(shape)}, got {tuple(advantages.shape)}"
    )


def float_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for logits: float32, or float64 when the logits already are."""
    return torch.promote_types(dtype, torch.float32)


def row_chunks(rows: int, vocab: int, elements: int | None = None) -> Iterator[slice]:
    """Slices of ``rows`` rows of ``vocab`` values each, at most ``elements`` values a slice
    (default ``_CHUNK_ELEMENTS``, read at each call), at least one row."""
    step = max(1, (elements or _CHUNK_ELEMENTS) // vocab)
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


class _ChunkedLogProbs(torch.autograd.Function):
    """Target logprobs whose forward and backward upcast the logits one chunk of rows at a time.

    Autograd through plain ops would keep every chunk's float32 copy for the backward, i.e. the
    whole ``[B, T, V]`` float32 tensor; here only the (low-precision) logits and the per-row
    log-normaliser are saved, and the softmax is recomputed chunk by chunk in the backward.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, target_ids: Tensor, temperature: float) -> Tensor:
        vocab = logits.shape[-1]
        flat_logits = logits.reshape(-1, vocab)
        flat_targets = target_ids.reshape(-1, 1)
        dtype = float_dtype(logits.dtype)
        log_normaliser = torch.empty(flat_logits.shape[0], dtype=dtype, device=logits.device)
        logprobs = torch.empty_like(log_normaliser)
        for rows in row_chunks(flat_logits.shape[0], vocab):
            scaled = flat_logits[rows].to(dtype) / temperature
            log_normaliser[rows] = scaled.logsumexp(-1)
            logprobs[rows] = scaled.gather(-1, flat_targets[rows]).squeeze(-1) - log_normaliser[rows]
        ctx.save_for_backward(logits, target_ids, log_normaliser)
        ctx.temperature = temperature
        return logprobs.view(target_ids.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs: Tensor) -> tuple[Tensor, None, None]:
        logits, target_ids, log_normaliser = ctx.saved_tensors
        vocab = logits.shape[-1]
        flat_logits = logits.reshape(-1, vocab)
        flat_targets = target_ids.reshape(-1, 1)
        flat_grad = grad_logprobs.reshape(-1, 1).to(log_normaliser.dtype)
        grad_logits = torch.empty_like(flat_logits)
        for rows in row_chunks(flat_logits.shape[0], vocab):
            scaled = flat_logits[rows].to(log_normaliser.dtype) / ctx.temperature
            # d logp[target] / d logits = (onehot(target) - softmax(logits / T)) / T
            grad = (scaled - log_normaliser[rows, None]).exp_().mul_(-flat_grad[rows])
            grad.scatter_add_(-1, flat_targets[rows], flat_grad[rows])
            grad_logits[rows] = grad.div_(ctx.temperature)
        return grad_logits.view_as(logits), None, None


def compute_logprobs(logits: Tensor, target_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Logprobs ``[B, T]`` of ``target_ids`` under ``softmax(logits / temperature)``.

    ``logits[:, t]`` scores ``target_ids[:, t]`` (the caller shifts). The result is float32
    (float64 for float64 logits) and differentiable with respect to ``logits``. For bf16/fp16
    logits no float32 copy of the whole ``[B, T, V]`` tensor is made: eager code upcasts one
    chunk of rows at a time in the forward and the backward, and under ``torch.compile``
    inductor fuses the upcast into the reductions.
    """
    check_logits("compute_logprobs", logits, target_ids)
    if temperature <= 0:
        raise ValueError(f"compute_logprobs: temperature must be > 0, got {temperature}")
    target_ids = target_ids.long()
    if torch.compiler.is_compiling():
        # A one-hot select rather than gather: gather's backward is a scatter into a float32
        # [B, T, V] buffer, while this backward is pointwise and fuses with the softmax term.
        scaled = logits.to(float_dtype(logits.dtype)) / temperature
        is_target = torch.arange(logits.shape[-1], device=logits.device) == target_ids.unsqueeze(-1)
        return torch.where(is_target, scaled, 0.0).sum(-1) - scaled.logsumexp(-1)
    return _ChunkedLogProbs.apply(logits, target_ids, temperature)


def _entropy(scaled_logits: Tensor) -> Tensor:
    logp = scaled_logits.log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def compute_entropy(logits: Tensor, loss_mask: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Per-token entropy ``[B, T]`` of ``softmax(logits / temperature)`` and its mean over response tokens.

    As a metric, call it under ``torch.no_grad()``: eager code upcasts bf16 logits one chunk of
    rows at a time, which bounds memory only when autograd is not recording. Recording, it is
    differentiable (an entropy bonus on the logits path) and keeps each chunk for the backward.
    """
    check_logits("compute_entropy", logits, loss_mask, "loss_mask")
    dtype = float_dtype(logits.dtype)
    if torch.compiler.is_compiling():
        entropy = _entropy(logits.to(dtype) / temperature)
    else:
        flat_logits = logits.reshape(-1, logits.shape[-1])
        chunks = row_chunks(flat_logits.shape[0], logits.shape[-1])
        entropy = torch.cat([_entropy(flat_logits[rows].to(dtype) / temperature) for rows in chunks])
        entropy = entropy.view(loss_mask.shape)
    return entropy, aggregate(entropy, loss_mask, "token_mean")


def compute_ratio(
    logprobs: Tensor, old_logprobs: Tensor, loss_mask: Tensor, level: RatioLevel = "token"
) -> tuple[Tensor, Tensor]:
    """Importance ratio ``pi / pi_old`` and its log, both ``[B, T]``.

    ``token``: ``exp(logp - old_logp)`` per token. ``sequence`` (GSPO): ``exp(mean_t log_ratio)``
    over each sequence's response tokens, broadcast to its tokens. Masked positions get ratio 1.
    """
    check_same_shape("compute_ratio", logprobs=logprobs, old_logprobs=old_logprobs, loss_mask=loss_mask)
    response = loss_mask != 0
    log_ratio = torch.where(response, logprobs - old_logprobs, 0.0)
    if level == "sequence":
        per_sequence = log_ratio.sum(-1) / response.sum(-1).clamp(min=1)
        log_ratio = per_sequence[:, None].expand_as(logprobs)
    elif level != "token":
        raise ValueError(f"compute_ratio: level must be 'token' or 'sequence', got {level!r}")
    return log_ratio.exp(), log_ratio


def compute_kl(
    logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k3", loss_mask: Tensor | None = None
) -> Tensor:
    """Per-token estimate ``[B, T]`` of ``KL(pi || ref)`` from tokens sampled from ``pi``.

    With ``r = ref_logprobs - logprobs`` (Schulman, "Approximating KL divergence", 2020):
    ``k1 = -r``, ``k2 = r**2 / 2``, ``k3 = exp(r) - r - 1``, ``low_var_kl = clamp(k3, -10, 10)``.
    Positions where ``loss_mask`` is zero get 0.
    """
    check_same_shape("compute_kl", logprobs=logprobs, ref_logprobs=ref_logprobs)
    log_ratio = ref_logprobs - logprobs
    if loss_mask is not None:
        check_same_shape("compute_kl", logprobs=logprobs, loss_mask=loss_mask)
        log_ratio = torch.where(loss_mask != 0, log_ratio, 0.0)
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator in ("k3", "low_var_kl"):
        # expm1 keeps precision where exp(r) - 1 would cancel (r near 0, i.e. almost always)
        k3 = torch.expm1(log_ratio) - log_ratio
        return k3 if estimator == "k3" else k3.clamp(-10.0, 10.0)
    raise ValueError(f"compute_kl: estimator must be one of k1, k2, k3, low_var_kl, got {estimator!r}")


def ppo_clip_loss(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO clipped surrogate per token, ``-min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)``.

    Also returns where the clip removed the token's gradient: ``r < 1 - clip_low`` with ``A < 0``
    (``clipped_low``) and ``r > 1 + clip_high`` with ``A > 0`` (``clipped_high``). At exactly
    ``1 +/- clip`` the gradient is kept.
    """
    check_same_shape("ppo_clip_loss", ratio=ratio, advantages=advantages)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -torch.minimum(ratio * advantages, clipped * advantages)
    clipped_low = (ratio < 1.0 - clip_low) & (advantages < 0)
    clipped_high = (ratio > 1.0 + clip_high) & (advantages > 0)
    return loss, clipped_low, clipped_high


def aggregate(
    values: Tensor,
    loss_mask: Tensor,
    mode: AggMode,
    horizon: int | None = None,
    step_tokens: Tensor | None = None,
    step_sequences: Tensor | None = None,
) -> Tensor:
    """Reduce per-token ``values [B, T]`` over response tokens to a scalar.

    - ``token_mean``: sum over all response tokens / their count (DAPO).
    - ``sequence_mean``: mean over each sequence's tokens, then over sequences (GRPO paper).
    - ``sequence_sum``: sum over each sequence's tokens, then mean over sequences.
    - ``fixed_horizon``: sum over all tokens / (B * horizon), a normaliser that does not depend on
      lengths (Dr. GRPO). ``horizon`` defaults to T, which varies with padding: pass the maximum
      generation length to keep it constant across batches.

    ``step_tokens`` / ``step_sequences`` (0-d tensors) replace the counts of this batch with those
    of a whole optimizer step (every microbatch of every data-parallel rank; sequences with at
    least one response token): the result is then this batch's share of the step's value, and
    the shares add up to it. Without them the counts are this batch's own.

    Empty masks: sequences without response tokens are left out of the sequence means, and a
    batch without any response token gives 0 (never NaN).
    """
    check_same_shape("aggregate", values=values, loss_mask=loss_mask)
    if values.dim() != 2:
        raise ValueError(f"aggregate: values must be [B, T], got {tuple(values.shape)}")
    response = loss_mask != 0
    masked = torch.where(response, values, 0.0)
    tokens = response.sum(-1)
    if mode == "token_mean":
        count = tokens.sum() if step_tokens is None else step_tokens
        return masked.sum() / count.clamp(min=1)
    if mode in ("sequence_mean", "sequence_sum"):
        per_sequence = masked.sum(-1)
        if mode == "sequence_mean":
            per_sequence = per_sequence / tokens.clamp(min=1)
        count = (tokens > 0).sum() if step_sequences is None else step_sequences
        return per_sequence.sum() / count.clamp(min=1)
    if mode == "fixed_horizon":
        horizon = values.shape[1] if horizon is None else horizon
        if horizon <= 0:
            raise ValueError(f"aggregate: horizon must be > 0, got {horizon}")
        count = values.shape[0] if step_sequences is None else step_sequences.clamp(min=1)
        return masked.sum() / (count * horizon)
    raise ValueError(
        f"aggregate: mode must be one of token_mean, sequence_mean, sequence_sum, fixed_horizon, got {mode!r}"
    )
