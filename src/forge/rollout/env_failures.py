"""Environment failures in rollouts, counted, and logged without flooding the log.

A trajectory whose environment failed (an ``EnvFailure``: a call raised, missed
``env.step_timeout_s``, returned the wrong type, or its environment was lost with its replica)
is rerun up to ``env.retries`` times (``rollout/env_retries``), then its group is dropped
(``rollout/env_failures``); failures past the deadline are counted in ``rollout/env_timeouts``.
The counts since the start explain a starving trainer (``forge.runs.guards``).

A flaky environment can fail thousands of times in a run: the first failure of each kind (the
call, and how it failed) is logged in full, the later ones as one count per kind and rollout
step.
"""

from __future__ import annotations

import logging
from collections import Counter

from forge.envs.sessions import EnvFailure
from forge.observability import Reduce, record_metric

logger = logging.getLogger(__name__)


class EnvFailures:
    def __init__(self):
        # Since the start.
        self.groups_dropped = 0
        self.timeouts = 0
        self.retries = 0
        self._logged: set[tuple[str, str]] = set()  # the kinds logged in full

    def retried(self, trajectories: int) -> None:
        record_metric("rollout/env_retries", trajectories, Reduce.SUM)
        self.retries += trajectories

    def dropped(self, groups: int) -> None:
        record_metric("rollout/env_failures", groups, Reduce.SUM)
        self.groups_dropped += groups

    def report(self, failures: list[EnvFailure]) -> None:
        """Counts and logs the failures of one rollout step."""
        timeouts = sum(f.kind == "timeout" for f in failures)
        if timeouts:
            record_metric("rollout/env_timeouts", timeouts, Reduce.SUM)
            self.timeouts += timeouts
        repeats: Counter[tuple[str, str]] = Counter()
        last: dict[tuple[str, str], str] = {}
        for failure in failures:
            kind = (failure.call, failure.kind)
            if kind in self._logged:
                repeats[kind] += 1
                last[kind] = failure.message
                continue
            self._logged.add(kind)
            logger.warning(
                "%s (its trajectory is rerun up to env.retries times, then its group is dropped; "
                "later %s() failures of this kind are logged as a count per rollout step)",
                failure.message,
                failure.call,
            )
        for (call, kind), n in repeats.items():
            logger.warning(
                "%d more environment %s() failures (%s) in this rollout step; the last: %s",
                n,
                call,
                kind,
                last[call, kind],
            )
