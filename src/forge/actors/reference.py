"""ReferenceModel: forward-only logprobs of the frozen initial policy (for the KL term)."""

from __future__ import annotations

import torch
from monarch.actor import endpoint

from forge.controller import ForgeActor
from forge.engines.titan.config import TitanEngineConfig


class ReferenceModel(ForgeActor):
    def __init__(self, engine: TitanEngineConfig, temperature: float = 1.0):
        self.engine_config = engine
        self.temperature = temperature

    @endpoint
    async def setup(self) -> None:
        from forge.engines.titan.engine import TitanEngine

        self.engine = TitanEngine(self.engine_config, trainable=False)

    @endpoint
    async def forward(self, tokens: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
        """`[B, T]` logprobs of `target_ids` given `tokens` (see `forge.data.episode_batch`)."""
        from forge.rl.ops import compute_logprobs

        with torch.no_grad():
            logits = self.engine.forward(tokens)
            return compute_logprobs(logits, target_ids.to(logits.device), self.temperature).cpu()
