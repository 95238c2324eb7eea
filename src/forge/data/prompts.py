"""Prompts (and targets) for RL, with a resumable cursor.

Rows come from the embedded toy task (`source: toy_task`), a local JSON/JSONL/Parquet
file with a prompt and a target column (`source: file`), or reasoning-gym's task generators
(`source: reasoning_gym`, `forge.data.reasoning_gym_source`). A prompt is a string or a list of
chat messages (`forge.data.chat_prompts`), from the prompt column or, in a file without one, the
messages column; the generator renders it with `chat_template`. Each epoch visits every training row
once in an order drawn from (seed, epoch), so `state_dict()` (epoch, position) fully
determines what comes next.
"""

from __future__ import annotations

import random
from typing import Any, Literal

from pydantic import Field

from forge.config import ForgeConfigModel
from forge.data.chat_prompts import ChatTemplateSetting, check_prompt
from forge.data.reasoning_gym_source import ReasoningGymConfig, make_reasoning_gym_rows
from forge.data.toy_task import ToyTaskConfig, make_splits

# {"prompt", "target"}, the prompt a string or chat messages; rows drawn from a cursor also
# carry "index", their position in the cursor's endless stream (the generator's sample key:
# see forge.actors.generator), and the rows a run serves carry "origin", where each came from
# (`with_origins`).
Row = dict[str, Any]


class PromptDataConfig(ForgeConfigModel):
    source: Literal["toy_task", "file", "reasoning_gym"] = "toy_task"
    toy_task: ToyTaskConfig = ToyTaskConfig()
    # For source=reasoning_gym: the tasks, how many rows, and their seed.
    reasoning_gym: ReasoningGymConfig | None = None
    # For source=file: local files with `prompt_column` (or `messages_column`) and `target_column`.
    path: str | None = None
    eval_path: str | None = None
    # A string or a list of {role, content} messages per row.
    prompt_column: str = "prompt"
    # Read only from a file without `prompt_column`: a file with both is usually an SFT set
    # whose messages end with the answer, so the prompts win.
    messages_column: str = "messages"
    target_column: str = "target"
    # How prompts become tokens (forge.data.chat_prompts): "auto" (the tokenizer's chat template,
    # if it has one), "none", or the path of a .jinja template.
    chat_template: ChatTemplateSetting = "auto"
    seed: int = Field(0, ge=0)


def read_prompt_target_rows(
    path: str, prompt_column: str, target_column: str, keys_hint: str, messages_column: str | None = None
) -> list[Row]:
    """``{"prompt", "target"}`` rows of a local dataset file, the prompt from ``prompt_column``, or
    from ``messages_column`` when the file has no ``prompt_column``. A missing column is an error
    that names the file, the columns it has, and the config keys (``keys_hint``) that choose them;
    a prompt that is neither a string nor chat messages, or a row without a target, names the
    file, the row (counted from 1) and the column."""
    from forge.data.files import load_split

    dataset = load_split(path, "train")
    columns = dataset.column_names
    if prompt_column not in columns and messages_column in columns:
        prompt_column = messages_column
    missing = [c for c in (prompt_column, target_column) if c not in columns]
    if missing:
        also = (
            f" (nor a messages column '{messages_column}')"
            if prompt_column in missing and messages_column
            else ""
        )
        raise ValueError(f"{path}: missing column(s) {missing}{also}; it has {columns} (set {keys_hint})")
    rows = []
    # Rows count from 1, as lines of a JSONL file and a JSON parser's messages do.
    for index, r in enumerate(dataset, start=1):
        check_prompt(r[prompt_column], f"{path}: row {index}, column '{prompt_column}'")
        if r[target_column] is None:  # str() would make it the target "None"
            raise ValueError(
                f"{path}: row {index}, column '{target_column}': the target is missing or null: give every "
                "row a target, or drop the row"
            )
        rows.append({"prompt": r[prompt_column], "target": str(r[target_column])})
    return rows


def _load_file(path: str, cfg: PromptDataConfig) -> list[Row]:
    return read_prompt_target_rows(
        path,
        cfg.prompt_column,
        cfg.target_column,
        "dataset.prompt_column or dataset.messages_column / dataset.target_column",
        cfg.messages_column,
    )


def load_prompt_rows(cfg: PromptDataConfig) -> tuple[list[Row], list[Row]]:
    """(train rows, eval rows); each row is {"prompt", "target"}."""
    if cfg.source == "toy_task":
        train, evaluation = make_splits(cfg.toy_task)
    elif cfg.source == "reasoning_gym":
        if cfg.reasoning_gym is None:
            raise ValueError(
                "dataset.reasoning_gym is required when dataset.source is 'reasoning_gym': give its tasks, "
                "e.g. dataset.reasoning_gym: {tasks: [{name: chain_sum}]}"
            )
        train, evaluation = make_reasoning_gym_rows(cfg.reasoning_gym)
    else:
        if cfg.path is None:
            raise ValueError("dataset.path is required when dataset.source is 'file'")
        train = _load_file(cfg.path, cfg)
        evaluation = _load_file(cfg.eval_path, cfg) if cfg.eval_path else []
    if not train:
        where = cfg.path if cfg.source == "file" else "the toy task (dataset.toy_task.num_train)"
        raise ValueError(f"the training prompt set from {where} is empty: there is nothing to train on")
    return [{"prompt": r["prompt"], "target": r["target"]} for r in train], [
        {"prompt": r["prompt"], "target": r["target"]} for r in evaluation
    ]


def with_origins(
    cfg: PromptDataConfig, train: list[Row], evaluation: list[Row]
) -> tuple[list[Row], list[Row]]:
    """The rows, each with its "origin": its set and its row there, which an error about that
    row names (rows count from 1, in the set's order: a file's lines, as `check_prompt_lengths`
    counts them)."""
    if cfg.source == "file":
        sets = (f"dataset.path {cfg.path}", f"dataset.eval_path {cfg.eval_path}")
    else:
        sets = (f"the {cfg.source} training set", f"the {cfg.source} eval set")
    return tuple(
        [{**row, "origin": f"{where}, row {number}"} for number, row in enumerate(rows, start=1)]
        for where, rows in zip(sets, (train, evaluation), strict=True)
    )


class PromptCursor:
    """Endless, seeded, resumable iteration over rows."""

    def __init__(self, rows: list[Row], seed: int):
        self.rows, self.seed = rows, seed
        self.epoch, self.position = 0, 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def next(self) -> Row:
        if self.position == len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._shuffled(self.epoch)
        row = {**self.rows[self._order[self.position]], "index": self.epoch * len(self.rows) + self.position}
        self.position += 1
        return row

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = self._shuffled(self.epoch)
