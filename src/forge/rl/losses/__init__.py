"""Losses for RL post-training and SFT, built by name from the app config.

``build_loss("grpo", clip_low=0.1)`` is what ``loss.name: grpo`` / ``loss.params: {...}`` becomes;
every loss is called as ``loss_fn(logits, batch) -> LossOutput`` with a
``forge.rl.batch.PolicyBatch``.
"""

from typing import Any

from forge.rl.losses.base import BaseLossConfig, Loss, LossOutput, PolicyLoss
from forge.rl.losses.ppo import DAPOLoss, GRPOLoss, GSPOLoss
from forge.rl.losses.reinforce import CISPOLoss, ReinforceLoss
from forge.rl.losses.sft import SFTLoss

LOSSES: dict[str, type[Loss]] = {
    "grpo": GRPOLoss,
    "dapo": DAPOLoss,
    "gspo": GSPOLoss,
    "cispo": CISPOLoss,
    "reinforce": ReinforceLoss,
    "sft": SFTLoss,
}


def build_loss(name: str, **params: Any) -> Loss:
    """The loss registered as ``name``, configured with ``params`` (unknown params raise)."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; known losses: {', '.join(LOSSES)}")
    return LOSSES[name](**params)


__all__ = [
    "LOSSES",
    "BaseLossConfig",
    "CISPOLoss",
    "DAPOLoss",
    "GRPOLoss",
    "GSPOLoss",
    "Loss",
    "LossOutput",
    "PolicyLoss",
    "ReinforceLoss",
    "SFTLoss",
    "build_loss",
]
