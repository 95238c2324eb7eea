"""SFT data: the config, the tokenized train/eval datasets, and the training loader.

Pipeline, one module per concern:

- ``forge.data.files``: read a split (local JSON / JSONL / Parquet, or a hub id);
- this module: check its columns for the format, truncate or drop too-long examples (and
  count them), and hold out the eval split;
- ``forge.sft.masking``: render and tokenize each example, with loss only on completion /
  assistant tokens (method and assumptions documented there);
- ``forge.sft.batches``: deterministic, resumable, infinite batches;
- ``forge.sft.collate``: padding, packing, and the shift (batch layout documented there).

What the app does::

    data = build_sft_data(config.data, tokenizer)      # record data.metrics once
    loader = build_sft_loader(config.data, data)
    loader.load_state_dict(run_state["data"])          # when resuming (forge.recipes.sft)
    batch = next(loader)  # input_ids, target_ids, loss_mask: [batch_size, row_len - 1]
    run_state["data"] = loader.state_dict()            # when checkpointing
"""

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

import datasets
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator
from transformers import PreTrainedTokenizerBase

from forge.data.files import load_split
from forge.sft.batches import SFTDataLoader
from forge.sft.masking import SFTExampleError, tokenize_messages, tokenize_prompt_completion

logger = logging.getLogger(__name__)

SFTFormat = Literal["prompt_completion", "messages"]


class SFTDataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    path: str = Field(description="a local .json/.jsonl/.parquet file, a local dataset folder, or a hub id")
    split: str = Field(
        "train", description="split to read; a local file's only split is 'train' (slices allowed)"
    )
    eval_path: str | None = Field(None, description="a separate eval dataset (exclusive with eval_fraction)")
    eval_split: str = "train"
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="hold out this share of `path` for eval")
    format: Literal["auto", "prompt_completion", "messages"] = "auto"
    prompt_column: str = "prompt"
    completion_column: str = "completion"
    messages_column: str = "messages"
    max_seq_len: int = Field(2048, ge=2, description="tokens per example, and per row when packing")
    overflow: Literal["truncate", "drop"] = "truncate"
    packing: bool = False
    batch_size: int = Field(8, ge=1, description="rows per batch")
    seed: int = Field(0, ge=0, description="seeds the eval hold-out and the per-epoch shuffles")
    shuffle: bool = True

    @model_validator(mode="after")
    def _one_eval_source(self) -> "SFTDataConfig":
        if self.eval_path is not None and self.eval_fraction > 0:
            raise ValueError("set eval_path or eval_fraction, not both")
        return self


@dataclass
class SFTData:
    """Tokenized datasets with columns ``input_ids`` and ``loss_mask`` (see ``forge.sft.masking``)."""

    train: datasets.Dataset
    eval: datasets.Dataset | None
    pad_id: int
    # data/{train,eval}_{examples,truncated,dropped}: examples kept, kept but cut to
    # max_seq_len, and removed (too long with overflow="drop", or left with no trained
    # token after truncation).
    metrics: dict[str, int]


def build_sft_data(config: SFTDataConfig, tokenizer: PreTrainedTokenizerBase) -> SFTData:
    train = _tokenize(load_split(config.path, config.split), config.path, config, tokenizer)
    if config.eval_path is not None:
        eval_ = _tokenize(
            load_split(config.eval_path, config.eval_split), config.eval_path, config, tokenizer
        )
    elif config.eval_fraction > 0:
        train, eval_ = _hold_out(train, config.eval_fraction, config.seed, config.path)
    else:
        eval_ = None
    train, metrics = _apply_overflow_policy(train, "train")
    if eval_ is not None:
        eval_, eval_metrics = _apply_overflow_policy(eval_, "eval")
        metrics.update(eval_metrics)
    return SFTData(train=train, eval=eval_, pad_id=_pad_id(tokenizer), metrics=metrics)


def build_sft_loader(config: SFTDataConfig, data: SFTData) -> SFTDataLoader:
    return SFTDataLoader(
        data.train,
        batch_size=config.batch_size,
        pad_id=data.pad_id,
        max_seq_len=config.max_seq_len,
        packing=config.packing,
        shuffle=config.shuffle,
        seed=config.seed,
    )


def _tokenize(
    dataset: datasets.Dataset, source: str, config: SFTDataConfig, tokenizer: PreTrainedTokenizerBase
) -> datasets.Dataset:
    """Tokenize every row, cut or mark too-long ones; adds an ``overflow`` status column."""
    sft_format = resolve_format(
        dataset.column_names,
        source,
        config.format,
        config.prompt_column,
        config.completion_column,
        config.messages_column,
    )

    def tokenize_row(row: dict[str, Any], index: int) -> dict[str, Any]:
        try:
            if sft_format == "messages":
                example = tokenize_messages(tokenizer, row[config.messages_column])
            else:
                example = tokenize_prompt_completion(
                    tokenizer, row[config.prompt_column], row[config.completion_column]
                )
        except SFTExampleError as error:
            # Rows count from 1, as lines of a JSONL file and a JSON parser's messages do.
            raise ValueError(f"{source}, row {index + 1}: {error}") from error
        return _fit_to_length(example, config.max_seq_len, config.overflow)

    # Never reuse a cached result: the cache key covers this closure but not the code of the
    # masking functions it calls, so a changed forge could silently reuse stale masks.
    return dataset.map(
        tokenize_row,
        with_indices=True,
        remove_columns=dataset.column_names,
        load_from_cache_file=False,
        desc=f"tokenizing {source}",
    )


def _fit_to_length(example: dict[str, list[int]], max_seq_len: int, overflow: str) -> dict[str, Any]:
    input_ids, loss_mask = example["input_ids"], example["loss_mask"]
    if len(input_ids) <= max_seq_len:
        return {"input_ids": input_ids, "loss_mask": loss_mask, "overflow": "none"}
    if overflow == "truncate" and any(loss_mask[:max_seq_len]):
        return {
            "input_ids": input_ids[:max_seq_len],
            "loss_mask": loss_mask[:max_seq_len],
            "overflow": "truncated",
        }
    return {"input_ids": [], "loss_mask": [], "overflow": "dropped"}


def _hold_out(
    dataset: datasets.Dataset, fraction: float, seed: int, source: str
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Split off a random ``fraction`` for eval; both parts keep the file's order."""
    eval_size = round(len(dataset) * fraction)
    if not 0 < eval_size < len(dataset):
        raise ValueError(
            f"{source}: eval_fraction={fraction} of {len(dataset)} rows leaves an empty train or eval split"
        )
    is_eval = np.zeros(len(dataset), dtype=bool)
    is_eval[np.random.default_rng(seed).choice(len(dataset), size=eval_size, replace=False)] = True
    return dataset.select(np.flatnonzero(~is_eval)), dataset.select(np.flatnonzero(is_eval))


def _apply_overflow_policy(dataset: datasets.Dataset, split: str) -> tuple[datasets.Dataset, dict[str, int]]:
    counts = Counter(dataset["overflow"])
    kept = dataset.filter(lambda status: status != "dropped", input_columns="overflow").remove_columns(
        "overflow"
    )
    if counts["truncated"] or counts["dropped"]:
        logger.warning(
            "%s split: %d examples truncated, %d dropped (longer than max_seq_len)",
            split,
            counts["truncated"],
            counts["dropped"],
        )
    metrics = {
        f"data/{split}_examples": len(kept),
        f"data/{split}_truncated": counts["truncated"],
        f"data/{split}_dropped": counts["dropped"],
    }
    return kept, metrics


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    # Padding always has loss mask 0, so eos serves when the tokenizer has no pad token.
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("the tokenizer has neither pad_token nor eos_token; set one of them")
    return pad_id


def generation_eval_rows(config: SFTDataConfig, target_column: str) -> list[dict]:
    """The eval split's ``{"prompt", "target"}`` rows for the greedy generation eval, in the
    data's own form: a chat's messages before its last assistant message, with that message's
    text as the target; or the prompt column with ``target_column``, else with the completion
    (prompt/completion data). Rows count from 1 in errors."""
    from forge.data.files import load_split
    from forge.data.prompts import read_prompt_target_rows

    path = config.eval_path
    if path is None:  # the held-out share of data.path is rows of the training file: not read here
        raise ValueError(
            "generation_eval reads its prompts from data.eval_path, which is unset: set it, or set "
            "~generation_eval to leave the greedy eval out"
        )
    dataset = load_split(path, "train")
    columns = dataset.column_names
    if config.prompt_column in columns or config.messages_column not in columns:
        if target_column not in columns and config.completion_column in columns:
            target_column = config.completion_column
        return read_prompt_target_rows(
            path,
            config.prompt_column,
            target_column,
            "data.prompt_column / generation_eval.target_column, which generation_eval reads",
        )
    rows = []
    for index, row in enumerate(dataset, start=1):
        messages = row[config.messages_column]
        answers = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if not answers or answers[-1] == 0:
            raise ValueError(
                f"{path}: row {index}: the generation eval needs messages that end in an assistant "
                "answer after at least one other message (the prompt); fix the row, or set "
                "~generation_eval to leave the greedy eval out"
            )
        last = answers[-1]
        rows.append({"prompt": list(messages[:last]), "target": str(messages[last]["content"])})
    return rows


def resolve_format(
    columns: list[str],
    source: str,
    requested: Literal["auto", "prompt_completion", "messages"],
    prompt_column: str,
    completion_column: str,
    messages_column: str,
) -> SFTFormat:
    """The dataset's format ("auto" picks it from the columns); raises if a column it
    needs is missing, naming the file, the column and the columns the file has."""
    if requested == "auto":
        if messages_column in columns:
            return "messages"
        if prompt_column in columns and completion_column in columns:
            return "prompt_completion"
        raise ValueError(
            f"{source}: cannot tell the SFT format: expected a {messages_column!r} column (chat) or "
            f"{prompt_column!r} and {completion_column!r} columns; the file has columns {columns}. "
            "Set the format and column names in the SFT data config."
        )
    needed = {
        "messages": {"messages_column": messages_column},
        "prompt_completion": {"prompt_column": prompt_column, "completion_column": completion_column},
    }[requested]
    for key, column in needed.items():
        if column not in columns:
            raise ValueError(
                f"{source}: missing column {column!r} needed by format {requested!r}; the file has "
                f"columns {columns}. Set {key} in the SFT data config to the right column."
            )
    return requested
