"""One policy for a scoring call that fails, whatever made it: a reward function, the reward
server or a reward model. Where a call runs, its failure becomes a `Failure` in place of its
values; the rollout's scorer (`forge.rewards.sources.RolloutScorer`) applies the policy to every
source's, in one place (`RewardFailures`).

The responses the call scored get ``error_reward``; the failure is logged and counted, in the
metric ``<metric_prefix>/<source>/errors`` (or ``/timeouts``) and in `counts`, the failures since
the start, which explain a run's state (a starving trainer: `forge.runs.guards`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from forge.observability import Reduce, record_metric

logger = logging.getLogger(__name__)

FailureKind = Literal["errors", "timeouts"]


@dataclass(eq=False)
class Failure:
    """A scoring call that failed, in place of the values of the responses it scored (one object
    for all of them: it counts once); `why` names the source and what went wrong, for the log."""

    kind: FailureKind
    why: str


class RewardFailures:
    def __init__(self, error_reward: float = 0.0, metric_prefix: str = "reward"):
        self.error_reward = error_reward
        self.metric_prefix = metric_prefix
        self._counts: dict[FailureKind, int] = {"errors": 0, "timeouts": 0}

    @property
    def counts(self) -> dict[FailureKind, int]:
        return dict(self._counts)

    def failed(self, source: str, kind: FailureKind, what: str, size: int) -> list[float]:
        """The values of a call of `source` that failed (`what`: the source and what went wrong,
        for the log) for the `size` responses it scored, counted once."""
        logger.warning("%s: scored %s", what, self.error_reward)
        record_metric(f"{self.metric_prefix}/{source}/{kind}", 1, Reduce.SUM)
        self._counts[kind] += 1
        return [self.error_reward] * size
