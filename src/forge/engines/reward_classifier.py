"""A Hugging Face sequence-classification model as a reward: it scores (prompt, response) pairs
in batches, in this process (no Monarch; `forge.actors.reward_models` serves it).

What a pair scores: with one label (a reward model's usual head), its logit; with several, the
softmax probability of the last label (a "good" class listed last, as binary classifiers do).
The text the model reads is its tokenizer's chat template over a user turn (the prompt) and an
assistant turn (the response) when it has one, else the prompt followed by the response. Texts
longer than the model's positions lose their start, not the response's end that is judged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ClassifierRewardEngine:
    def __init__(self, path: str, batch_size: int = 32, dtype: str = "float32", device: str | None = None):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=getattr(torch, dtype))
        self.model.to(self.device).eval()
        # The head reads the last token that is not padding: the model must know which id pads.
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.max_length = getattr(self.model.config, "max_position_embeddings", None)

    def text(self, prompt: str, response: str) -> str:
        if self.tokenizer.chat_template is None:
            return prompt + response
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    def encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        # A chat template writes its own special tokens; plain text gets the tokenizer's.
        return self.tokenizer(
            texts,
            return_tensors="pt",
            padding=True,
            truncation=self.max_length is not None,
            max_length=self.max_length,
            add_special_tokens=self.tokenizer.chat_template is None,
        ).to(self.device)

    @torch.no_grad()
    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        """One score per (prompt, response), `batch_size` pairs per forward."""
        if len(prompts) != len(responses):
            raise ValueError(f"score(): {len(prompts)} prompts but {len(responses)} responses")
        texts = [self.text(p, r) for p, r in zip(prompts, responses, strict=True)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            logits = self.model(**self.encode(texts[start : start + self.batch_size])).logits.float()
            values = logits[:, 0] if logits.shape[-1] == 1 else logits.softmax(-1)[:, -1]
            scores += values.tolist()
        return scores
