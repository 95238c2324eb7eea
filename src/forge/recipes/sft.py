"""The SFT recipe's reusable pieces: data preparation, data-parallel shares of a batch,
held-out evaluation through the trainer actor, run checkpoints, and greedy accuracy of an
exported model.

Data preparation runs in the controller process, before any actor starts, so that a bad
file or column fails in a second with a clear message instead of after a mesh spawned.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import Field, model_validator
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from forge.data.chat_prompts import PromptRenderer
from forge.data.tokenizer import embedded_tokenizer
from forge.data.toy_task import ToyTaskConfig, make_splits, write_jsonl
from forge.engines.generation import SamplingParams
from forge.engines.hf_generate import HFGenerateEngine
from forge.observability import record_metric
from forge.rewards.functions import RewardFn
from forge.rl.batch import PolicyBatch
from forge.rollout.eval import greedy_accuracy
from forge.runs.checkpoint import RunCheckpointer, controller_rng_state, set_controller_rng_state
from forge.sft.batches import SFTDataLoader, eval_batches
from forge.sft.dataset import SFTData, SFTDataConfig, build_sft_data


class SFTRecipeDataConfig(SFTDataConfig):
    """``SFTDataConfig`` whose data comes either from local files (``path``, with the app's
    ``tokenizer_path``) or from the embedded toy task (``embedded_task``), which needs no files."""

    path: str | None = Field(
        None, description="a local .json/.jsonl/.parquet file, a local dataset folder, or a hub id"
    )
    embedded_task: ToyTaskConfig | None = Field(
        None, description="train on the embedded arithmetic task; its files are written into the run dir"
    )

    @model_validator(mode="after")
    def _one_source(self) -> "SFTRecipeDataConfig":
        if (self.path is None) == (self.embedded_task is None):
            raise ValueError("set exactly one of data.path (a dataset file) and data.embedded_task")
        if self.embedded_task is not None and (self.eval_path is not None or self.eval_fraction > 0):
            raise ValueError(
                "data.embedded_task writes its own held-out split: leave data.eval_path and "
                "data.eval_fraction unset"
            )
        return self


@dataclass
class PreparedData:
    config: SFTDataConfig
    """The data config with ``path``/``eval_path`` pointing at the files actually read."""
    tokenizer: PreTrainedTokenizerBase
    tokenizer_dir: Path
    """A local copy of the tokenizer files: exports take them from here."""
    data: SFTData


def prepare_data(
    cfg: SFTRecipeDataConfig, tokenizer_source: tuple[str, str] | None, run_dir: Path
) -> PreparedData:
    """Write the embedded task's files if asked, load the tokenizer (from ``tokenizer_source``:
    a local dir or hub id, and the config key that named it), tokenize both splits.

    Raises ``ValueError`` / ``OSError`` naming the file, key or column at fault.
    """
    path, eval_path = cfg.path, cfg.eval_path
    if cfg.embedded_task is not None:
        train_rows, eval_rows = make_splits(cfg.embedded_task)
        path = str(write_jsonl(train_rows, run_dir / "data" / "train.jsonl"))
        eval_path = str(write_jsonl(eval_rows, run_dir / "data" / "eval.jsonl"))
        tokenizer = embedded_tokenizer()
    else:
        tokenizer = load_tokenizer(tokenizer_source)
    # A hub tokenizer has no local files to copy into an export; a saved copy always does.
    tokenizer_dir = run_dir / "tokenizer"
    tokenizer.save_pretrained(tokenizer_dir)
    config = SFTDataConfig.model_validate(
        {**cfg.model_dump(exclude={"embedded_task"}), "path": path, "eval_path": eval_path}
    )
    data = build_sft_data(config, tokenizer)
    if data.eval is not None and len(data.eval) == 0:
        raise ValueError(
            f"{eval_path or path}: the eval split is empty after dropping examples longer than "
            f"max_seq_len={config.max_seq_len}; raise data.max_seq_len or use data.overflow=truncate"
        )
    return PreparedData(config, tokenizer, tokenizer_dir, data)


def load_tokenizer(source: tuple[str, str] | None) -> PreTrainedTokenizerBase:
    if source is None:
        raise ValueError(
            "data.path needs a tokenizer: set tokenizer_path (a local tokenizer dir or a hub id), or "
            "trainer.engine.model.hf_path to a checkpoint that holds one"
        )
    path, key = source
    try:
        return AutoTokenizer.from_pretrained(path)
    except OSError as error:
        raise OSError(f"{key} '{path}': cannot load a tokenizer: {error}") from None


def split_for_ranks(batch: dict[str, torch.Tensor], ranks: int) -> list[PolicyBatch]:
    """A batch from the SFT loader as the trainer's ``PolicyBatch`` list (one share per rank).

    Every rank needs at least one row (an evaluation batch may be shorter than ``ranks``): missing
    rows are filled with copies of row 0 whose loss mask is zero, so they weigh nothing.
    """
    rows = batch["input_ids"].shape[0]
    if rows % ranks:
        fill = ranks - rows % ranks
        batch = {name: torch.cat([t, t[:1].expand(fill, *t.shape[1:])]) for name, t in batch.items()}
        batch["loss_mask"][rows:] = 0
    return [
        PolicyBatch(target_ids=ids, loss_mask=mask, tokens=tokens)
        for tokens, ids, mask in zip(
            batch["input_ids"].chunk(ranks),
            batch["target_ids"].chunk(ranks),
            batch["loss_mask"].chunk(ranks),
            strict=True,
        )
    ]


async def evaluate_loss(trainer, data: SFTData, batch_size: int, ranks: int) -> dict[str, float]:
    """Token-weighted loss, token accuracy and perplexity over the whole eval split; also
    recorded as metrics (``eval/...``).

    The trainer reports each share's token mean; weighting them by their token counts gives the
    exact mean over every eval token, whatever the batch boundaries. ``ranks`` is the trainer's
    data-parallel size: the ranks of a tensor-parallel group (consecutive) report the same share.
    """
    tokens = loss_sum = correct_sum = 0.0
    for batch in eval_batches(data.eval, batch_size=batch_size, pad_id=data.pad_id):
        shares = split_for_ranks(batch, ranks)
        results = await trainer.evaluate.route_per_rank(shares)
        for metrics, share in zip(results[:: len(results) // ranks], shares, strict=True):
            count = float(share.loss_mask.sum())
            tokens += count
            loss_sum += metrics["eval/loss"] * count
            correct_sum += metrics["eval/token_accuracy"] * count
    loss = loss_sum / tokens
    metrics = {
        "eval/loss": loss,
        "eval/token_accuracy": correct_sum / tokens,
        "eval/perplexity": math.exp(loss),
        "eval/tokens": tokens,
    }
    for key, value in metrics.items():
        record_metric(key, value)
    return metrics


async def save_checkpoint(checkpoints: RunCheckpointer, step: int, trainer, loader: SFTDataLoader) -> Path:
    """A run checkpoint of `step`: the trainer's state (model, optimizer, LR schedule, step), the
    loader's position and this process's RNG states."""
    state = {"step": step, "data": loader.state_dict(), "rng": controller_rng_state()}
    return await checkpoints.write(trainer, state)


async def restore_checkpoint(checkpoints: RunCheckpointer, trainer, loader: SFTDataLoader) -> int | None:
    """Puts the trainer, the loader and the RNG states back as the newest intact checkpoint
    saved them; returns its step (None: there is no checkpoint)."""
    path = checkpoints.newest_intact()
    if path is None:
        return None
    state = await checkpoints.read(path, trainer)
    loader.load_state_dict(state["data"])
    set_controller_rng_state(state["rng"])
    return state["step"]


def greedy_exact_match(
    model_dir: str | Path,
    rows: Sequence[dict[str, str]],
    reward_fn: RewardFn,
    max_tokens: int,
    batch_size: int = 64,
) -> float:
    """Fraction of ``rows`` whose greedy completion by the Hugging Face model in ``model_dir``
    gets the full reward (1.0), measured as the GRPO app measures its policy: the prompt is
    rendered as the Generator renders it (``forge.data.chat_prompts``, chat template ``auto``),
    the output decoded without special tokens."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    renderer = PromptRenderer(tokenizer, "auto")
    # The tokenizer's eos is authoritative: the exported config.json does not name one.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = HFGenerateEngine(model, eos_token_id=tokenizer.eos_token_id)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    scores = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        rendered = [renderer.render(row["prompt"]) for row in chunk]
        outputs = engine.generate([r.ids for r in rendered], params)
        for row, prompt, (sequence,) in zip(chunk, rendered, outputs, strict=True):
            text = tokenizer.decode(sequence.token_ids, skip_special_tokens=True)
            scores.append(reward_fn(prompt.text, text, row["target"]))
    return greedy_accuracy(scores, len(rows))
