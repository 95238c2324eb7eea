"""PPO's clipped value loss, the critic's (``forge.engines.titan.value.ValueEngine``).

Not a policy loss: it reads the value model's outputs ``[B, T, 1]`` (one value per position),
not token scores, and is not among ``forge.rl.losses.LOSSES``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from forge.rl.batch import PolicyBatch
from forge.rl.losses.base import LossOutput
from forge.rl.ops import aggregate


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, clip: float | None
) -> tuple[Tensor, Tensor]:
    """Per token ``[B, T]``: ``0.5 * max((V - R)^2, (V_clip - R)^2)`` with ``V_clip = V_old +
    clamp(V - V_old, -clip, clip)`` (PPO's value clipping: the new value may not move the loss
    down by leaving the old one by more than ``clip``); and where the clipped term is the larger
    (bool). ``clip`` None: ``0.5 * (V - R)^2``, never clipped."""
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped, torch.zeros(values.shape, dtype=torch.bool, device=values.device)
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


class ValueLoss:
    """The mean of ``clipped_value_loss`` over the step's trained tokens (``loss_mask``), as this
    micro-batch's share (``step_tokens``). Metrics (shares of the step's, summed by the trainer):
    ``critic/value_loss``, ``critic/clip_frac`` and ``critic/values`` (the mean value)."""

    def __init__(self, clip: float | None) -> None:
        self.clip = clip

    def __call__(self, outputs: Tensor, batch: PolicyBatch) -> LossOutput:
        if outputs.dim() != 3 or outputs.shape[-1] != 1:
            raise ValueError(
                f"ValueLoss: the value model's outputs must be [B, T, 1], got {tuple(outputs.shape)}"
            )
        values = outputs[..., 0].float()
        old_values, returns = batch.values.to(values.device), batch.returns.to(values.device)
        per_token, clipped = clipped_value_loss(values, old_values, returns, self.clip)
        loss = aggregate(per_token, batch.loss_mask, "token_mean", step_tokens=batch.step_tokens)
        metrics = {
            "critic/value_loss": loss.detach(),
            "critic/clip_frac": aggregate(
                clipped.to(torch.float64), batch.loss_mask, "token_mean", step_tokens=batch.step_tokens
            ),
            "critic/values": aggregate(
                values.detach(), batch.loss_mask, "token_mean", step_tokens=batch.step_tokens
            ),
        }
        return LossOutput(loss, metrics)
