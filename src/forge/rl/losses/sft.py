"""Supervised fine-tuning: masked cross-entropy on the target tokens."""

import torch
from torch import Tensor

from forge.rl.batch import PolicyBatch
from forge.rl.losses.base import AggregatedLossConfig, Loss, LossOutput, token_mean
from forge.rl.ops import aggregate, check_logits, check_same_shape, compute_logprobs


class SFTLossConfig(AggregatedLossConfig):
    pass


class SFTLoss(Loss):
    """Masked cross-entropy, ``loss = agg_t[-log p(y_t)]`` over the tokens where ``loss_mask`` is set.

    Call it as ``sft(logits, PolicyBatch(target_ids=targets, loss_mask=mask))``; the batch's other
    fields are not read. Metrics: ``sft/loss`` and ``sft/token_accuracy`` (argmax equals target);
    the perplexity is ``exp`` of the token-mean loss over the whole step, so the trainer's
    ``train/loss`` gives it (a share of it per microbatch would not add up).
    """

    config_class = SFTLossConfig
    config: SFTLossConfig

    def __call__(self, logits: Tensor, batch: PolicyBatch) -> LossOutput:
        check_logits("SFTLoss", logits, batch.target_ids)
        check_same_shape("SFTLoss", target_ids=batch.target_ids, loss_mask=batch.loss_mask)
        response = batch.loss_mask != 0
        # Padded targets may hold an ignore index such as -100; any valid id does there.
        target_ids = torch.where(response, batch.target_ids, 0)
        nll = -compute_logprobs(logits, target_ids)
        loss = aggregate(
            nll, response, self.config.agg_type, self.config.horizon, batch.step_tokens, batch.step_sequences
        )
        with torch.no_grad():
            correct = (logits.detach().argmax(-1) == target_ids).to(torch.float32)
            metrics = {
                "sft/loss": loss.detach(),
                "sft/token_accuracy": token_mean(correct, batch),
            }
        return LossOutput(loss, metrics)
