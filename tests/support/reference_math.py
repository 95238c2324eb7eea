"""Independent float64 references for forge.rl, written with Python floats and loops only.

Shared by the RL tests (tests/support is on pytest's pythonpath; see pyproject.toml).
"""

import math


def ref_logprob(row: list[float], target: int, temperature: float = 1.0) -> float:
    scaled = [x / temperature for x in row]
    top = max(scaled)
    return scaled[target] - (top + math.log(sum(math.exp(x - top) for x in scaled)))


def ref_softmax(row: list[float], temperature: float = 1.0) -> list[float]:
    scaled = [x / temperature for x in row]
    top = max(scaled)
    exps = [math.exp(x - top) for x in scaled]
    return [e / sum(exps) for e in exps]


def ref_entropy(row: list[float], temperature: float = 1.0) -> float:
    return -sum(p * math.log(p) for p in ref_softmax(row, temperature) if p > 0)


def ref_aggregate(
    values: list[list[float]],
    mask: list[list[int]],
    mode: str,
    horizon: int | None = None,
    step: tuple[int, int] | None = None,
) -> float:
    """``step`` = (loss tokens, sequences with a loss token) of a whole optimizer step, replacing
    this batch's own counts in the denominators."""
    batch, length = len(values), len(values[0])
    masked = [[v for v, m in zip(vs, ms, strict=True) if m] for vs, ms in zip(values, mask, strict=True)]
    total = sum(sum(row) for row in masked)
    tokens = sum(len(row) for row in masked)
    sequences = sum(1 for row in masked if row)
    if step is not None:
        tokens, sequences = step
    if mode == "token_mean":
        return total / tokens if tokens else 0.0
    if mode in ("sequence_mean", "sequence_sum"):
        per_sequence = [sum(row) / len(row) if mode == "sequence_mean" else sum(row) for row in masked if row]
        return sum(per_sequence) / sequences if sequences else 0.0
    assert mode == "fixed_horizon"
    return total / ((batch if step is None else sequences) * (horizon or length))


def ref_kl(logprob: float, ref: float, estimator: str) -> float:
    r = ref - logprob
    if estimator == "k1":
        return -r
    if estimator == "k2":
        return r * r / 2
    k3 = math.exp(r) - r - 1
    return k3 if estimator == "k3" else min(max(k3, -10.0), 10.0)
