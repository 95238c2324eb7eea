"""Per-token logprobs of completions' responses under a ``TitanEngine``: the reference model's
computation, in one process or on every rank of a data/tensor-parallel group."""

from collections.abc import Sequence

import torch

from forge.data.types import Completion
from forge.engines.titan.engine import TitanEngine
from forge.engines.titan.shares import Share, share_of
from forge.rl.batch import pad_sequences, response_rows


def completion_logprobs(
    engine: TitanEngine, completions: Sequence[Completion], temperature: float = 1.0
) -> list[list[float]]:
    """Per completion, the logprob of each response token given the tokens before it, under
    ``softmax(logits / temperature)``, micro-batched (and packed) as the engine trains."""
    tokens, target_ids, span = pad_sequences(
        [c.prompt_ids for c in completions], [c.response_ids for c in completions], pad_id=0
    )
    logprobs = engine.score_tokens(tokens, target_ids, span, temperature).logprobs
    return response_rows(logprobs, span)


def share_logprobs(engine: TitanEngine, completions: Sequence[Completion], temperature: float = 1.0) -> Share:
    """``completion_logprobs`` of this rank's data-parallel share of ``completions``
    (``forge.engines.titan.shares``; ``join_shares`` puts the ranks' shares back in order). Every rank of
    the engine's process group must call it, with the same completions."""
    share = share_of(completions, engine.dp_rank, engine.dp_size)
    if share:
        values = completion_logprobs(engine, share, temperature)
    else:
        # The forwards are collectives (FSDP gathers each layer's parameters from every rank,
        # TP reduces across its group): a rank with nothing to compute still runs as many as
        # the others, or the ranks that have work would wait for it forever.
        empty = torch.zeros((0, 1), dtype=torch.long)
        engine.score_tokens(empty, empty, empty, temperature)
        values = []
    return Share(engine.dp_rank, engine.dp_size, values)
