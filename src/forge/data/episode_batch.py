"""Turn scored episodes into the padded tensors the trainer's loss consumes.

For an episode with prompt ids p (length P) and response ids r (length R) the sequence is
s = p + r. The model reads ``tokens = s[:-1]`` and ``logits[:, t]`` predicts
``target_ids[:, t] = s[t + 1]``, so the response tokens are the targets at positions
``P - 1 .. P + R - 2``: that is where ``loss_mask`` is 1 and where the generator's (and
reference's) per-token logprobs are placed. Rows are right-padded to the longest one.
"""

from __future__ import annotations

import torch

from forge.data.types import Episode


def collate_episodes(episodes: list[Episode], pad_id: int) -> tuple[dict, dict]:
    """Returns ``(inputs, targets)``: ``inputs["tokens"]`` and the loss's other arguments."""
    if not episodes:
        raise ValueError("collate_episodes needs at least one episode")
    width = max(ep.prompt_len + ep.response_len for ep in episodes) - 1
    batch = len(episodes)
    tokens = torch.full((batch, width), pad_id, dtype=torch.long)
    target_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(batch, width)
    generator_logprobs = torch.zeros(batch, width)
    with_ref = all(ep.ref_logprobs is not None for ep in episodes)
    ref_logprobs = torch.zeros(batch, width) if with_ref else None
    for i, ep in enumerate(episodes):
        seq = torch.tensor(ep.completion.prompt_ids + ep.completion.response_ids, dtype=torch.long)
        tokens[i, : len(seq) - 1] = seq[:-1]
        target_ids[i, : len(seq) - 1] = seq[1:]
        start, end = ep.prompt_len - 1, ep.prompt_len - 1 + ep.response_len
        loss_mask[i, start:end] = 1.0
        generator_logprobs[i, start:end] = torch.tensor(ep.completion.logprobs)
        if ref_logprobs is not None:
            ref_logprobs[i, start:end] = torch.tensor(ep.ref_logprobs)
    targets = {
        "target_ids": target_ids,
        "loss_mask": loss_mask,
        "advantages": torch.tensor([ep.advantage for ep in episodes], dtype=torch.float32),
        "generator_logprobs": generator_logprobs,
        "ref_logprobs": ref_logprobs,
    }
    return {"tokens": tokens}, targets


def response_logprobs(
    logprobs: torch.Tensor, prompt_lens: list[int], response_lens: list[int]
) -> list[list[float]]:
    """The inverse of the placement above: each row's response-token logprobs as a list."""
    return [
        logprobs[i, p - 1 : p - 1 + r].tolist()
        for i, (p, r) in enumerate(zip(prompt_lens, response_lens, strict=True))
    ]
