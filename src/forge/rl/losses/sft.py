"""Supervised fine-tuning: masked cross-entropy on the target tokens."""

from typing import Literal

import torch

from forge.rl.batch import PolicyBatch
from forge.rl.losses.base import AggregatedLossConfig, Loss, LossOutput, token_mean
from forge.rl.ops import aggregate
from forge.rl.token_scores import TokenScores


class SFTLossConfig(AggregatedLossConfig):
    name: Literal["sft"] = "sft"


class SFTLoss(Loss):
    """Masked cross-entropy, ``loss = agg_t[-log p(y_t)]`` over the tokens where ``loss_mask`` is set.

    Call it as ``sft(logits, PolicyBatch(target_ids=targets, loss_mask=mask))``; the batch's other
    fields are not read. Metrics: ``sft/loss`` and ``sft/token_accuracy`` (argmax equals target);
    the perplexity is ``exp`` of the token-mean loss over the whole step, so the trainer's
    ``train/loss`` gives it (a share of it per microbatch would not add up).
    """

    config_class = SFTLossConfig
    config: SFTLossConfig

    def from_scores(self, scores: TokenScores, batch: PolicyBatch) -> LossOutput:
        response = batch.loss_mask != 0
        loss = aggregate(
            -scores.logprobs,
            response,
            self.config.agg_type,
            self.config.horizon,
            batch.step_tokens,
            batch.step_sequences,
        )
        with torch.no_grad():
            correct = scores.is_argmax.to(torch.float32)
            metrics = {
                "sft/loss": loss.detach(),
                "sft/token_accuracy": token_mean(correct, batch),
            }
        return LossOutput(loss, metrics)
