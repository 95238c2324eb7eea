"""The model's output projection, which can score target tokens instead of returning logits.

The engine swaps it in for the model's ``output`` linear layer before parallelizing, keeping
the same weight (so tied embeddings stay tied, and FSDP and compile treat it as the linear layer
it is). Inside ``scoring(...)`` its forward returns the targets' ``[B, T, 3]`` scores
(``forge.rl.token_scores.head_scores``) instead of ``[B, T, V]`` logits: the model's ``forward``
runs unchanged, with every wrapper's hooks, and the logits never exist.
"""

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from forge.rl.token_scores import head_scores


class ScoringHead(nn.Linear):
    @classmethod
    def replacing(cls, linear: nn.Linear) -> "ScoringHead":
        head = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        head.weight = linear.weight
        if linear.bias is not None:
            head.bias = linear.bias
        return head

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._targets: torch.Tensor | None = None
        self._temperature = 1.0
        self._entropy_grad = False
        # The first rows, those scored (ModelConfig.sampled_rows); None: all.
        self.scored_rows: int | None = None

    @contextlib.contextmanager
    def scoring(
        self, target_ids: torch.Tensor, temperature: float, entropy_grad: bool = False
    ) -> Iterator[None]:
        """While active, ``forward(hidden [B, T, D])`` returns the scores of ``target_ids`` ``[B, T]``
        (``head_scores``; ``entropy_grad``: the entropy carries a gradient)."""
        self._targets, self._temperature, self._entropy_grad = target_ids, temperature, entropy_grad
        try:
            yield
        finally:
            self._targets = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._targets is None:
            return super().forward(hidden)
        rows = slice(self.scored_rows)
        bias = None if self.bias is None else self.bias[rows]
        return head_scores(
            hidden, self.weight[rows], bias, self._targets, self._temperature, self._entropy_grad
        )
