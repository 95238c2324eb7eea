"""A minimal loss for TitanEngine tests: the engine only needs `.loss` and `.metrics`."""

from dataclasses import dataclass

import torch


@dataclass
class LossOutput:
    loss: torch.Tensor
    metrics: dict


def masked_ce(logits: torch.Tensor, batch: dict) -> LossOutput:
    """Next-token cross entropy over the positions where loss_mask is set."""
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logprobs.gather(-1, batch["tokens"][:, 1:].unsqueeze(-1)).squeeze(-1)
    mask = batch["loss_mask"][:, 1:].float()
    loss = (nll * mask).sum() / mask.sum()
    return LossOutput(loss, {"loss/nll": loss.detach()})
