"""Losses for RL post-training and SFT, built by name or from a config file's loss section.

``build_loss("grpo", clip_low=0.1)`` builds a loss in code; a config's ``loss: {name: grpo,
clip_low: 0.1}`` is a ``LossConfig`` (that loss's own config, chosen by ``name``), built with
``loss_from_config``. Every loss is called as ``loss_fn(logits, batch) -> LossOutput`` with a
``forge.rl.batch.PolicyBatch``.
"""

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BeforeValidator, Field

from forge.rl.losses.base import BaseLossConfig, Loss, LossOutput, PolicyLoss
from forge.rl.losses.ppo import (
    DAPOLoss,
    DAPOLossConfig,
    GRPOLoss,
    GRPOLossConfig,
    GSPOLoss,
    GSPOLossConfig,
    PPOLoss,
    PPOLossConfig,
)
from forge.rl.losses.reinforce import CISPOLoss, CISPOLossConfig, ReinforceLoss, ReinforceLossConfig
from forge.rl.losses.sft import SFTLoss, SFTLossConfig

LOSSES: dict[str, type[Loss]] = {
    "grpo": GRPOLoss,
    "dapo": DAPOLoss,
    "gspo": GSPOLoss,
    "ppo": PPOLoss,
    "cispo": CISPOLoss,
    "reinforce": ReinforceLoss,
    "sft": SFTLoss,
}


def _registered(name: str) -> type[Loss]:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; known losses: {', '.join(LOSSES)}")
    return LOSSES[name]


def build_loss(name: str, **params: Any) -> Loss:
    """The loss registered as ``name``, configured with ``params`` (unknown params raise)."""
    return _registered(name)(**params)


def _known_loss(section: Any) -> Any:
    """A loss section without a name is GRPO's; an unknown name is refused, naming the known ones."""
    if not isinstance(section, Mapping):
        return section
    name = section.get("name", "grpo")
    _registered(name)
    return {**section, "name": name}


LossConfig = Annotated[
    GRPOLossConfig
    | PPOLossConfig
    | DAPOLossConfig
    | GSPOLossConfig
    | CISPOLossConfig
    | ReinforceLossConfig
    | SFTLossConfig,
    Field(discriminator="name"),
    BeforeValidator(_known_loss),
]
"""A config file's loss section: the config of the loss that ``name`` picks (default ``grpo``)."""


def loss_from_config(config: BaseLossConfig) -> Loss:
    """The loss a ``LossConfig`` describes."""
    return LOSSES[config.name].from_config(config)


__all__ = [
    "LOSSES",
    "BaseLossConfig",
    "CISPOLoss",
    "DAPOLoss",
    "GRPOLoss",
    "GSPOLoss",
    "Loss",
    "LossConfig",
    "LossOutput",
    "PPOLoss",
    "PolicyLoss",
    "ReinforceLoss",
    "SFTLoss",
    "build_loss",
    "loss_from_config",
]
