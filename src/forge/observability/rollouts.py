"""Rollout records: one JSON object per episode that enters the replay buffer, and per eval answer.

The controller, which already holds every episode on its way to the buffer, hands them to a
`RolloutRecorder`. Turning them into JSON and writing happen on a background thread, so
the rollout loops only pay for building a few small dicts (see bench/rollout_records_bench.py).

A record of a training episode carries what a person reads (prompt, completion, reward,
advantage, ...) and what replay mode (`rollout.replay_from`) needs to rebuild the exact
training batch (token ids, generator and reference logprobs, the episode id). The replay
buffer writes, next to it, which episodes each training batch held (`batches_path`).
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from forge.data.types import Completion, Episode

# What a training record holds, and in which order (the file is read by people too).
RECORD_FIELDS = (
    "step",
    "policy_version",
    "eval",
    "prompt",
    "completion",
    "target",
    "reward",
    "reward_breakdown",
    "advantage",
    "response_len",
    "stop_reason",
    "group_id",
    "episode_id",
    "prompt_ids",
    "response_ids",
    "logprobs",
    "ref_logprobs",
)


def batches_path(rollouts_path: str | Path) -> Path:
    """Where the replay buffer records the episode ids of each training batch."""
    path = Path(rollouts_path)
    return path.with_name(f"{path.stem}.batches.jsonl")


def episode_record(step: int, episode: Episode) -> dict[str, Any]:
    c = episode.completion
    return {
        "step": step,
        "policy_version": c.policy_version,
        "eval": False,
        "prompt": c.prompt,
        "completion": c.text,
        "target": episode.target,
        "reward": episode.reward,
        "reward_breakdown": episode.reward_breakdown,
        "advantage": episode.advantage,
        "response_len": c.response_len,
        "stop_reason": c.stop_reason,
        "group_id": episode.group_id,
        "episode_id": episode.episode_id,
        "prompt_ids": c.prompt_ids,
        "response_ids": c.response_ids,
        "logprobs": c.logprobs,
        "ref_logprobs": episode.ref_logprobs,
    }


def eval_record(step: int, completion: Completion, target: str, reward: float) -> dict[str, Any]:
    return {
        "step": step,
        "policy_version": completion.policy_version,
        "eval": True,
        "prompt": completion.prompt,
        "completion": completion.text,
        "target": target,
        "reward": reward,
        "response_len": completion.response_len,
        "stop_reason": completion.stop_reason,
    }


class RolloutRecorder:
    """Appends rollout records to a JSONL file from a background thread.

    `every` keeps one group in N (whole groups, so that advantages can be read against
    their group); eval answers are all kept. `step` is the training step the records are
    stamped with: the training loop advances it.
    """

    def __init__(self, path: str | Path, every: int = 1):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.every = every
        self.step = 0
        self._groups_seen = 0
        self._file = self.path.open("w", encoding="utf-8")
        self._queue: queue.SimpleQueue[list[dict] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._write_loop, name="rollout-records", daemon=True)
        self._thread.start()

    def record_groups(self, groups: list[list[Episode]]) -> None:
        """Records the episodes of the groups that entered the buffer (one group in `every`)."""
        records = []
        for group in groups:
            if self._groups_seen % self.every == 0:
                records.extend(episode_record(self.step, episode) for episode in group)
            self._groups_seen += 1
        self._put(records)

    def record_eval(self, completions: list[Completion], targets: list[str], rewards: list[float]) -> None:
        self._put(
            [eval_record(self.step, c, t, r) for c, t, r in zip(completions, targets, rewards, strict=True)]
        )

    def _put(self, records: list[dict]) -> None:
        if self._error is not None:
            raise RuntimeError(f"writing rollout records to {self.path} failed") from self._error
        if records:
            self._queue.put(records)

    def _write_loop(self) -> None:
        try:
            while (records := self._queue.get()) is not None:
                self._file.write("".join(json.dumps(r) + "\n" for r in records))
                if self._queue.empty():
                    self._file.flush()
        except BaseException as e:  # surfaced to the caller by the next record or close
            self._error = e

    def close(self) -> None:
        """Writes what is queued and closes the file."""
        self._queue.put(None)
        self._thread.join()
        self._file.close()
        if self._error is not None:
            raise RuntimeError(f"writing rollout records to {self.path} failed") from self._error


def read_records(path: str | Path) -> Iterator[dict[str, Any]]:
    with Path(path).open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {line_no}: not a JSON object ({e.msg})") from None
