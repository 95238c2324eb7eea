"""Running the reward functions, with a time limit on every call, and the reward server.

A reward function is user code: it may raise, return something that is not a finite number
(None, a string, ``inf``), never return, end its process (``os._exit``, a crash in C code) or
print megabytes. None of these may stop a run. A call that does not return a finite number, runs
longer than ``timeout_s`` or maps more than ``memory_limit_gib`` of memory (beyond what the
imported functions hold) gives a `Failure` (an error or a timeout) in place of its values: the
rollout's scorer (`forge.rewards.sources.RolloutScorer`) scores ``error_reward`` for the
responses it scored and counts it once, as it does every source's failed calls.

A hung call cannot be interrupted inside the process that runs it (Python cannot kill a
thread, and C code may ignore signals), but a child process can be killed. So with a
``timeout_s`` the functions run in a worker process (``forge.rewards.worker``), which
imports them once and runs each batch of calls in processes forked from it: one for the
whole batch, in order, while nothing fails; after a call fails, one per remaining call, all
at once, so that the batch's hung calls time out together (a batch takes about two
``timeout_s`` at most, not one per hung call; see `forge.rewards.worker.run_batch`).
Calls run at once share the machine's cores: a reward function that needs seconds of CPU per call
wants a ``timeout_s`` well above that. Only plain data comes back from the worker.
The worker exits when its pipe from this process closes: at `close`, or when this process
dies however it dies; its forked processes die with it.

A group reward function (`forge.rewards.group_functions`) is called once per group, in the same
batch and under the same limits; a call of it that fails gives one `Failure` for every response
of its group. A reward server (``remote``, `forge.rewards.remote`) scores the same responses over
HTTP, in threads of this process, while the worker runs: it has its own timeouts and retries,
and gives a `Failure` for a batch that fails for good.
"""

from __future__ import annotations

from forge.rewards.failures import Failure
from forge.rewards.functions import get_reward_fn
from forge.rewards.group_functions import is_group_reward
from forge.rewards.remote import REMOTE, RemoteRewardConfig, RemoteScorer
from forge.rewards.worker import ERROR, TIMEOUT, Call, Outcome, RewardWorker, call_here

COUNTERS = {ERROR: "errors", TIMEOUT: "timeouts"}
# Each response's values by name: a number, or the `Failure` of the call that scored it (one
# object for all the responses of that call).
Breakdown = dict[str, float | Failure]


class RewardScorer:
    """Runs weighted reward functions and, with ``remote``, a reward server
    (`forge.rewards.remote`) on responses, group by group (see the module docstring): each
    response's values by name, a `Failure` where a call failed. The rollout's scorer weighs
    them (`weights`).

    ``timeout_s=None`` runs the functions in this process, with no time or memory limit.
    """

    def __init__(
        self,
        functions: list[tuple[str, float]],
        timeout_s: float | None = None,
        memory_limit_gib: float | None = None,
        remote: RemoteRewardConfig | None = None,
    ):
        self.functions = [(name, weight, get_reward_fn(name)) for name, weight in functions]
        self.timeout_s = timeout_s
        self._worker = (
            RewardWorker([name for name, _ in functions], timeout_s, memory_limit_gib) if timeout_s else None
        )
        self._remote = RemoteScorer(remote) if remote is not None else None

    def start(self) -> None:
        """Starts the worker process now rather than at the first scoring (it takes a second or
        more to import the functions), e.g. while a run's actors start."""
        if self._worker is not None:
            self._worker.start()

    @property
    def weights(self) -> dict[str, float]:
        """{function name: weight}, and the reward server's under ``remote``: the breakdown's keys."""
        weights = {name: weight for name, weight, _ in self.functions}
        if self._remote is not None:
            weights[REMOTE] = self._remote.cfg.weight
        return weights

    def score_many(self, items: list[tuple[str, str, str]]) -> list[Breakdown]:
        """The values of each (prompt, response, target), each response a group of its own, in one
        batch."""
        groups = self.score_groups(
            [[p] for p, _, _ in items], [[r] for _, r, _ in items], [t for *_, t in items]
        )
        return [breakdown for [breakdown] in groups]

    def score_groups(
        self, prompts: list[list[str]], responses: list[list[str]], targets: list[str]
    ) -> list[list[Breakdown]]:
        """The values of each response of each group (its prompts, its responses, its target), in
        one batch of calls to the worker: one call per response of each function, one per group
        of each group function, while the reward server scores the same responses."""
        groups = [
            [(p, r, target) for p, r in zip(group_prompts, group, strict=True)]
            for group_prompts, group, target in zip(prompts, responses, targets, strict=True)
        ]
        # The reward server scores the responses while the worker runs the functions.
        items = [item for group in groups for item in group]
        remote = self._remote.submit(items) if self._remote is not None else None
        breakdowns = self._function_values(groups)
        if remote is not None:
            remote_values = iter(remote.result())
            for group_breakdowns in breakdowns:
                for breakdown in group_breakdowns:
                    breakdown[REMOTE] = next(remote_values)
        return breakdowns

    def _function_values(self, groups: list[list[tuple[str, str, str]]]) -> list[list[Breakdown]]:
        """{function name: its value} of each response of each group of (prompt, response, target)."""
        calls: list[Call] = []
        positions: list[tuple[int, range]] = []  # the group and the responses each call scores
        for g, group in enumerate(groups):
            for i, (_, _, fn) in enumerate(self.functions):
                if not is_group_reward(fn):
                    calls += [(i, *item) for item in group]
                    positions += [(g, range(j, j + 1)) for j in range(len(group))]
                elif group:
                    calls.append((i, *(list(column) for column in zip(*group, strict=True))))
                    positions.append((g, range(len(group))))
        values = [[{} for _ in group] for group in groups]
        for (i, _, response, _), (g, scored), outcome in zip(calls, positions, self._run(calls), strict=True):
            name = self.functions[i][0]
            for j, value in zip(scored, self._values(name, outcome, response, len(scored)), strict=True):
                values[g][j][name] = value
        return values

    def _run(self, calls: list[Call]) -> list[Outcome]:
        if not calls:  # no functions, only the reward server: no worker to start
            return []
        if self._worker is not None:
            return self._worker.run(calls)
        return [call_here(self.functions[i][2], p, r, t) for i, p, r, t in calls]

    @staticmethod
    def _values(name: str, outcome: Outcome, response: str | list[str], size: int) -> list[float | Failure]:
        """The values a call's outcome gives its `size` responses: one `Failure` for all of them
        when it failed."""
        if not isinstance(outcome, tuple):
            return outcome if isinstance(outcome, list) else [outcome]
        kind, why = outcome
        scored = (
            f"the group of {size} responses starting {response[0][:200]!r}"
            if isinstance(response, list)
            else f"response {response[:200]!r}"
        )
        return [Failure(COUNTERS[kind], f"reward function '{name}' {why} on {scored}")] * size

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._remote is not None:
            self._remote.close()
