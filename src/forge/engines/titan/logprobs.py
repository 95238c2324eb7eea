"""Per-token logprobs of completions' responses under a ``TitanEngine``: the reference model's
computation, in one process or on every rank of a data/tensor-parallel group."""

from collections.abc import Sequence

import torch

from forge.data.shares import Share, share_of
from forge.data.types import Completion
from forge.engines.titan.engine import TitanEngine
from forge.rl.batch import pad_sequences, response_rows
from forge.rl.ops import compute_logprobs


def completion_logprobs(
    engine: TitanEngine, completions: Sequence[Completion], temperature: float = 1.0
) -> list[list[float]]:
    """Per completion, the logprob of each response token given the tokens before it, under
    ``softmax(logits / temperature)``: one forward over the completions padded to the longest."""
    tokens, target_ids, span = pad_sequences(
        [c.prompt_ids for c in completions], [c.response_ids for c in completions], pad_id=0
    )
    logits = engine.forward(tokens)
    logprobs = compute_logprobs(logits, target_ids.to(logits.device), temperature).cpu()
    return response_rows(logprobs, span)


def share_logprobs(engine: TitanEngine, completions: Sequence[Completion], temperature: float = 1.0) -> Share:
    """``completion_logprobs`` of this rank's data-parallel share of ``completions``
    (``forge.data.shares``; ``join_shares`` puts the ranks' shares back in order). Every rank of
    the engine's process group must call it, with the same completions."""
    share = share_of(completions, engine.dp_rank, engine.dp_size)
    if share:
        values = completion_logprobs(engine, share, temperature)
    else:
        # The forward is a collective (FSDP gathers each layer's parameters from every rank,
        # TP reduces across its group): a rank with nothing to compute still runs one, on one
        # token, or the ranks that have work would wait for it forever.
        engine.forward(torch.zeros((1, 1), dtype=torch.long))
        values = []
    return Share(engine.dp_rank, engine.dp_size, values)
