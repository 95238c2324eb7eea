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
    values: list[list[float]], mask: list[list[int]], mode: str, horizon: int | None = None
) -> float:
    batch, length = len(values), len(values[0])
    if mode == "token_mean":
        kept = [v for vs, ms in zip(values, mask, strict=True) for v, m in zip(vs, ms, strict=True) if m]
        return sum(kept) / len(kept) if kept else 0.0
    if mode in ("sequence_mean", "sequence_sum"):
        per_sequence = []
        for vs, ms in zip(values, mask, strict=True):
            kept = [v for v, m in zip(vs, ms, strict=True) if m]
            if kept:
                per_sequence.append(sum(kept) / len(kept) if mode == "sequence_mean" else sum(kept))
        return sum(per_sequence) / len(per_sequence) if per_sequence else 0.0
    assert mode == "fixed_horizon"
    total = sum(v for vs, ms in zip(values, mask, strict=True) for v, m in zip(vs, ms, strict=True) if m)
    return total / (batch * (horizon or length))


def ref_kl(logprob: float, ref: float, estimator: str) -> float:
    r = ref - logprob
    if estimator == "k1":
        return -r
    if estimator == "k2":
        return r * r / 2
    k3 = math.exp(r) - r - 1
    return k3 if estimator == "k3" else min(max(k3, -10.0), 10.0)
