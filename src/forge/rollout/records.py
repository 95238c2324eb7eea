"""Rollout records: one JSON object per episode that enters the replay buffer, and per eval answer.

The controller, which already holds every episode on its way to the buffer, hands them to a
`RolloutRecorder`. Building the records, turning them into JSON and writing all happen on a
background thread: the rollout loop only queues a reference to the groups (see
bench/rollout_records_bench.py for what the thread costs).

A record of a training episode carries what a person reads (prompt, completion, reward,
advantage, ...) and what replay mode (`rollout.replay_from`) needs to rebuild the exact
training batch (token ids, generator and reference logprobs, per-token advantages, the
episode id). The replay
buffer writes, next to it, which episodes each training batch held (`batches_path`).

Per-token arrays are stored as base64 of little-endian int32 (token ids) and float32
(logprobs and advantages; the trainer reads them as float32, so this is exact): a GPU-sized step has
millions of them, and JSON numbers cost several times more to write and read.
"""

from __future__ import annotations

import base64
import json
import logging
import queue
import sys
import threading
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from forge.data.types import Completion, Episode, Turn
from forge.observability.jsonl import JsonlAppender, keep_rows, read_jsonl

logger = logging.getLogger(__name__)

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
    "turns",
    "truncated",
    "response_mask",
)
# What a training record adds when a judge model scored it: its answers, by the judge's name.
NOTE_FIELDS = ("reward_notes",)
# What a training record adds when its episode trains with per-token advantages.
TOKEN_ADVANTAGE_FIELDS = ("token_advantages",)
# What a training record adds when a critic scored its episode (PPO).
VALUE_FIELDS = ("values", "returns")


def _encode(typecode: str, values: list | None) -> str | None:
    if values is None:
        return None
    packed = array(typecode, values)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def _decode(typecode: str, encoded: str | None) -> list | None:
    if encoded is None:
        return None
    packed = array(typecode, base64.b64decode(encoded))
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()


def encode_floats(values: list[float] | None) -> str | None:
    """Base64 of the values as little-endian float32."""
    return _encode("f", values)


def decode_floats(encoded: str | None) -> list[float] | None:
    return _decode("f", encoded)


def encode_ids(ids: list[int]) -> str:
    """Base64 of token ids as little-endian int32."""
    return _encode("i", ids)


def decode_ids(encoded: str) -> list[int]:
    return _decode("i", encoded)


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
        "prompt_ids": encode_ids(c.prompt_ids),
        "response_ids": encode_ids(c.response_ids),
        "logprobs": encode_floats(c.logprobs),
        "ref_logprobs": encode_floats(episode.ref_logprobs),
        **turn_fields(c),
        **({"reward_notes": episode.reward_notes} if episode.reward_notes else {}),
        **(
            {"token_advantages": encode_floats(episode.token_advantages)}
            if episode.token_advantages is not None
            else {}
        ),
        **{
            name: encode_floats(getattr(episode, name))
            for name in VALUE_FIELDS
            if getattr(episode, name) is not None
        },
    }


def turn_fields(c: Completion) -> dict[str, Any]:
    """A trajectory's parts (who wrote what, how many tokens, the step rewards; one model turn
    without an environment) and its loss mask."""
    return {
        "turns": [vars(t) for t in c.turns],
        "truncated": c.truncated,
        "response_mask": encode_ids(c.response_mask),
    }


def turns_from_record(record: dict[str, Any]) -> list[Turn] | None:
    """The record's turns; None for a one-turn record written before records carried turns."""
    return [Turn(**t) for t in record["turns"]] if record.get("turns") is not None else None


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
        **turn_fields(completion),
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
        # Appended across resumes: the resume drops what came after its checkpoint first
        # (`trim_run_records`).
        self._file = JsonlAppender(self.path)
        # Items are (step, groups) of training episodes or ready eval records; None stops.
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._error_raised = False
        self._thread = threading.Thread(target=self._write_loop, name="rollout-records", daemon=True)
        self._thread.start()

    def record_groups(self, groups: list[list[Episode]]) -> None:
        """Records the episodes of the groups that entered the buffer (one group in `every`).
        The episodes must not change afterwards: the thread reads them later."""
        kept = [g for i, g in enumerate(groups, start=self._groups_seen) if i % self.every == 0]
        self._groups_seen += len(groups)
        if kept:
            self._put((self.step, kept))

    def record_eval(self, completions: list[Completion], targets: list[str], rewards: list[float]) -> None:
        self._put(
            [eval_record(self.step, c, t, r) for c, t, r in zip(completions, targets, rewards, strict=True)]
        )

    def _put(self, item: tuple[int, list[list[Episode]]] | list[dict]) -> None:
        if self._error is not None:
            self._raise_error()
        self._queue.put(item)

    def _raise_error(self) -> None:
        self._error_raised = True
        raise RuntimeError(f"writing rollout records to {self.path} failed") from self._error

    def _write_loop(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                if isinstance(item, tuple):
                    step, groups = item
                    item = [episode_record(step, episode) for group in groups for episode in group]
                self._file.write_lines("".join(json.dumps(r) + "\n" for r in item))
        except BaseException as e:  # surfaced to the caller by the next record or close
            self._error = e

    def close(self) -> None:
        """Writes what is queued and closes the file; raises a failure to write that no record
        call has raised yet (once: closing again is harmless)."""
        self._queue.put(None)
        self._thread.join()
        self._file.close()
        if self._error is not None and not self._error_raised:
            self._raise_error()

    def __enter__(self) -> RolloutRecorder:
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        """Closes the recorder. Under an error of the block's own (an actor that died, a full
        disk met by a checkpoint) a failure to write is logged, not raised: raised, it would
        hide that error, which says why the run stopped."""
        if error is None:
            self.close()
            return
        try:
            self.close()
        except Exception as failure:
            logger.warning("%s (%s); the run stops with its own error", failure, failure.__cause__)


def read_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """The records of a file, skipping a last line cut short with a warning (``read_jsonl``)."""
    return read_jsonl(path)


def trim_run_records(rollouts_path: str | Path, step: int) -> None:
    """Before a run resumed from the checkpoint of ``step`` appends again: drops the records
    stamped after ``step`` and the batch records of the steps after it (one per training step)."""
    dropped = keep_rows(rollouts_path, lambda _, record: record["step"] <= step)
    dropped_batches = keep_rows(batches_path(rollouts_path), lambda index, _: index < step)
    if dropped or dropped_batches:
        logger.info(
            "resume: dropped %d rollout and %d batch records after step %d", dropped, dropped_batches, step
        )
