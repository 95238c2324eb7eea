"""ReferenceModel: forward-only logprobs of the frozen initial policy (for the KL term)."""

from __future__ import annotations

import torch
from monarch.actor import endpoint

from forge.controller import ForgeActor
from forge.data.types import Completion
from forge.engines.titan.config import TitanEngineConfig
from forge.rl.batch import pad_sequences, response_rows


class ReferenceModel(ForgeActor):
    def __init__(self, engine: TitanEngineConfig, temperature: float = 1.0):
        self.engine_config = engine
        self.temperature = temperature

    @endpoint
    async def setup(self) -> None:
        from forge.engines.titan.engine import TitanEngine

        self.engine = TitanEngine(self.engine_config, trainable=False)

    @endpoint
    async def forward(self, completions: list[Completion]) -> list[list[float]]:
        """Per completion, the logprob of each response token given the tokens before it."""
        from forge.rl.ops import compute_logprobs

        tokens, target_ids, span = pad_sequences(
            [c.prompt_ids for c in completions], [c.response_ids for c in completions], pad_id=0
        )
        with torch.no_grad():
            logits = self.engine.forward(tokens)
            logprobs = compute_logprobs(logits, target_ids.to(logits.device), self.temperature).cpu()
        return response_rows(logprobs, span)
