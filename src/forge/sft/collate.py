"""Turn tokenized SFT examples into a shifted, padded training batch.

A batch is a dict of three tensors of shape ``[batch, row_len - 1]``, already shifted:

- ``input_ids``: what the model reads (``tokens[:, :-1]``),
- ``target_ids``: what ``logits[:, t]`` must predict (``tokens[:, 1:]``),
- ``loss_mask``: float32, 1.0 where ``target_ids[:, t]`` carries loss (``mask[:, 1:]``).

The trainer calls ``loss_fn(model(batch["input_ids"]), batch["target_ids"], ...,
loss_mask=batch["loss_mask"])`` with no further slicing. Padding uses ``pad_id`` and
always has loss mask 0, so any valid token id works as ``pad_id``.

Each row holds one or more examples back to back. Without packing a row holds one example
and rows are padded to the longest example of the batch. With packing a row holds as many
whole examples as fit in ``max_seq_len`` tokens (examples are never split) and rows are
padded to exactly ``max_seq_len``.

What packing does: the model (TorchTitan qwen3, SDPA causal attention) has no
per-document attention mask, so a token may attend to the earlier documents of its row,
and RoPE positions run on across documents, as in TorchTitan's pre-training loader. The
loss mask stays exact per document: each document's trained tokens are exactly its
unpacked ones, and the first token of every document is never a target (see
``forge.sft.masking``), so no loss is taken on predicting one document from the previous one.
Per-document position ids are not produced: without a matching attention mask they
would give a document negative distances to the one before it.
"""

from collections.abc import Sequence

import torch


def collate_rows(
    rows: Sequence[Sequence[dict[str, list[int]]]], row_len: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """Lay each row's examples back to back, pad to ``row_len`` tokens, and shift."""
    tokens = torch.full((len(rows), row_len), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(rows), row_len), dtype=torch.float32)
    for row_index, examples in enumerate(rows):
        offset = 0
        for example in examples:
            length = len(example["input_ids"])
            if offset + length > row_len:
                raise ValueError(f"row {row_index} needs more than {row_len} tokens")
            tokens[row_index, offset : offset + length] = torch.tensor(example["input_ids"], dtype=torch.long)
            loss_mask[row_index, offset : offset + length] = torch.tensor(
                example["loss_mask"], dtype=torch.float32
            )
            offset += length
    return {
        "input_ids": tokens[:, :-1].contiguous(),
        "target_ids": tokens[:, 1:].contiguous(),
        "loss_mask": loss_mask[:, 1:].contiguous(),
    }
