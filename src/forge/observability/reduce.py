"""Exact, mergeable metric accumulators.

Every process keeps, per metric key, the count, sum, min, max and (count, mean, M2) of the
values recorded since the last flush. These merge exactly (Chan et al.'s parallel variance
update), so the logger reports the true global mean and standard deviation over all
values from all processes, not a mean of per-process means or stds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum


class Reduce(Enum):
    MEAN = "mean"
    SUM = "sum"
    MAX = "max"
    MIN = "min"
    STD = "std"


@dataclass
class Accumulator:
    reduce: Reduce
    count: int = 0
    total: float = 0.0
    mean: float = 0.0
    m2: float = 0.0
    min: float = math.inf
    max: float = -math.inf

    def add(self, value: float) -> None:
        self.merge(Accumulator(self.reduce, 1, value, value, 0.0, value, value))

    def merge(self, other: Accumulator) -> None:
        if other.reduce is not self.reduce:
            raise ValueError(
                f"metric recorded with two reductions: {self.reduce.name} and {other.reduce.name}; "
                "use one reduction per key"
            )
        if other.count == 0:
            return
        n = self.count + other.count
        delta = other.mean - self.mean
        self.m2 += other.m2 + delta * delta * self.count * other.count / n
        self.mean += delta * other.count / n
        self.count = n
        self.total += other.total
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)

    def value(self) -> float:
        if self.reduce is Reduce.MEAN:
            return self.mean
        if self.reduce is Reduce.SUM:
            return self.total
        if self.reduce is Reduce.MAX:
            return self.max
        if self.reduce is Reduce.MIN:
            return self.min
        # Population std over every recorded value.
        return math.sqrt(self.m2 / self.count) if self.count else 0.0


def merge_states(states: list[dict[str, Accumulator]]) -> dict[str, Accumulator]:
    merged: dict[str, Accumulator] = {}
    for state in states:
        for key, acc in state.items():
            if key not in merged:
                merged[key] = Accumulator(acc.reduce)
            try:
                merged[key].merge(acc)
            except ValueError as e:
                raise ValueError(f"metric '{key}': {e}") from None
    return merged
