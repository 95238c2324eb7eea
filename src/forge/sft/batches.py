"""Deterministic, resumable SFT batches over a tokenized dataset.

The data order is a pure function of ``(seed, epoch, position)``: epoch ``e`` visits the
examples in the permutation drawn from ``numpy.random.default_rng([seed, e])`` (or in file
order without shuffling), and ``position`` is the index in that order of the next example
to consume. ``state_dict()`` after a batch therefore pins down every later batch, and a run
resumed from it sees exactly the batches a straight run would have seen.
"""

import logging
from collections.abc import Iterator
from typing import Any

import datasets
import numpy as np
import torch

from forge.sft.collate import collate_rows

logger = logging.getLogger(__name__)

STATE_KEYS = ("epoch", "position", "seed")


class SFTDataLoader:
    """Infinite iterator of training batches (see ``forge.sft.collate`` for the batch layout).

    Every batch has ``batch_size`` rows; a batch that reaches the end of an epoch goes on
    with the start of the next one.
    """

    def __init__(
        self,
        dataset: datasets.Dataset,
        *,
        batch_size: int,
        pad_id: int,
        max_seq_len: int,
        packing: bool = False,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if len(dataset) == 0:
            raise ValueError(
                "SFTDataLoader got an empty dataset: every example was dropped or the split is empty"
            )
        if batch_size < 1 or seed < 0:
            raise ValueError(
                f"batch_size must be >= 1 and seed >= 0, got batch_size={batch_size}, seed={seed}"
            )
        self._dataset = dataset.select_columns(["input_ids", "loss_mask"])
        self._batch_size = batch_size
        self._pad_id = pad_id
        self._max_seq_len = max_seq_len
        self._packing = packing
        self._shuffle = shuffle
        self._seed = seed
        self._epoch = 0
        self._position = 0
        self._order_epoch = -1
        self._order = np.arange(0)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "position": self._position, "seed": self._seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [key for key in STATE_KEYS if key not in state]
        if missing:
            raise KeyError(f"SFT loader state is missing {missing}; got keys {sorted(state)}")
        if not 0 <= state["position"] < len(self._dataset):
            raise ValueError(
                f"SFT loader state position {state['position']} is outside the dataset's "
                f"{len(self._dataset)} examples: the dataset or its max_seq_len/overflow settings changed"
            )
        if state["seed"] != self._seed:
            # The checkpoint's seed wins, so that the resumed run continues the same order.
            logger.warning(
                "SFT loader: resuming with the checkpoint's seed %d, not %d", state["seed"], self._seed
            )
        self._epoch, self._position, self._seed = (
            int(state["epoch"]),
            int(state["position"]),
            int(state["seed"]),
        )
        self._order_epoch = -1

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._packing:
            rows = [self._take_packed_row() for _ in range(self._batch_size)]
            return collate_rows(rows, self._max_seq_len, self._pad_id)
        rows = [[self._take()] for _ in range(self._batch_size)]
        return collate_rows(rows, max(len(row[0]["input_ids"]) for row in rows), self._pad_id)

    def _take_packed_row(self) -> list[dict[str, list[int]]]:
        row: list[dict[str, list[int]]] = []
        used = 0
        while True:
            length = len(self._peek()["input_ids"])
            if length > self._max_seq_len:
                raise ValueError(
                    f"an example has {length} tokens, more than max_seq_len={self._max_seq_len}: "
                    "build the dataset with the loader's max_seq_len"
                )
            if row and used + length > self._max_seq_len:
                return row
            row.append(self._take())
            used += length

    def _peek(self) -> dict[str, list[int]]:
        if self._order_epoch != self._epoch:
            self._order = self._epoch_order(self._epoch)
            self._order_epoch = self._epoch
        return self._dataset[int(self._order[self._position])]

    def _take(self) -> dict[str, list[int]]:
        example = self._peek()
        self._position += 1
        if self._position == len(self._dataset):
            self._epoch += 1
            self._position = 0
        return example

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self._shuffle:
            return np.arange(len(self._dataset))
        return np.random.default_rng([self._seed, epoch]).permutation(len(self._dataset))


def eval_batches(
    dataset: datasets.Dataset, *, batch_size: int, pad_id: int
) -> Iterator[dict[str, torch.Tensor]]:
    """One pass over ``dataset`` in order, unpacked; the last batch may be smaller."""
    for start in range(0, len(dataset), batch_size):
        rows = [[dataset[index]] for index in range(start, min(start + batch_size, len(dataset)))]
        yield collate_rows(rows, max(len(row[0]["input_ids"]) for row in rows), pad_id)
