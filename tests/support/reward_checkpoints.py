"""A tiny sequence-classification reward model with random weights and the embedded tokenizer,
saved as a user brings one (save_pretrained)."""

from __future__ import annotations

from pathlib import Path

import torch
from hf_checkpoints import tiny_qwen3_config
from transformers import Qwen3ForSequenceClassification

from forge.data.tokenizer import embedded_tokenizer


def make_classifier(root: Path, num_labels: int = 1, seed: int = 0) -> Path:
    tokenizer = embedded_tokenizer()
    config = tiny_qwen3_config(
        len(tokenizer),
        tokenizer.eos_token_id,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
        architectures=["Qwen3ForSequenceClassification"],
    )
    torch.manual_seed(seed)
    out = root / f"classifier{num_labels}"
    Qwen3ForSequenceClassification(config).to(torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
