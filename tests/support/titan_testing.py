"""A minimal loss and batch builder for TitanEngine tests: the engine only needs `.loss`,
`.metrics` and `.reductions`."""

from dataclasses import dataclass, field

import torch

from forge.rl.batch import PolicyBatch


@dataclass
class LossOutput:
    loss: torch.Tensor
    metrics: dict
    reductions: dict = field(default_factory=dict)


def lm_batch(sequences: torch.Tensor, loss_mask: torch.Tensor | None = None) -> PolicyBatch:
    """Next-token prediction on ``sequences [B, L]``: the model reads ``[:, :-1]`` and predicts
    ``[:, 1:]`` where ``loss_mask [B, L]`` (default: everywhere) is set."""
    mask = torch.ones_like(sequences, dtype=torch.bool) if loss_mask is None else loss_mask
    return PolicyBatch(target_ids=sequences[:, 1:], loss_mask=mask[:, 1:], tokens=sequences[:, :-1])


def masked_ce(logits: torch.Tensor, batch: PolicyBatch) -> LossOutput:
    """Next-token cross entropy over the positions where loss_mask is set: this batch's share
    of the step's token mean (of its own token mean outside a train step)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    nll = -logprobs.gather(-1, batch.target_ids.unsqueeze(-1)).squeeze(-1)
    mask = batch.loss_mask.float()
    loss = (nll * mask).sum() / (mask.sum() if batch.step_tokens is None else batch.step_tokens)
    nll_max = torch.where(mask > 0, nll.detach(), -torch.inf).max()
    return LossOutput(loss, {"loss/nll": loss.detach(), "loss/nll_max": nll_max}, {"loss/nll_max": "max"})
