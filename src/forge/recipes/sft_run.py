"""An SFT run in this process: its start-up (checks and data, before any process starts), then
the training loop over the `TitanTrainer` actor, with held-out eval, run checkpoints, the
Hugging Face export and the export's greedy exact match (`forge.recipes.sft` has the pieces).

What the run tells its user (where it resumes, the export, the exact match) goes to `report`,
which the app prints; the step lines are the progress display's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from forge.actors.trainer import TitanTrainer
from forge.config import config_to_dict
from forge.controller import shutdown
from forge.engines.titan.checkpoint_model import check_model_section
from forge.observability import Reduce, get_metric_logger, record_metric
from forge.observability.backends import drop_metrics_after
from forge.observability.progress import Progress
from forge.recipes.sft import (
    PreparedData,
    evaluate_loss,
    greedy_exact_match,
    prepare_data,
    restore_checkpoint,
    save_checkpoint,
    split_for_ranks,
)
from forge.rewards.functions import get_reward_fn
from forge.runs.checkpoint import RunCheckpointer
from forge.runs.checks import check_no_earlier_metrics
from forge.runs.storage import check_writable_dir
from forge.runs.task_dump import log_tasks_on_sigusr1
from forge.sft.batches import SFTDataLoader
from forge.sft.config import SFTConfig
from forge.sft.dataset import build_sft_loader, generation_eval_rows

Report = Callable[[str], None]


@dataclass
class SFTStart:
    """What the run starts from: the prepared data, its batches, and the prompts and targets of
    the generation eval (None without one)."""

    prepared: PreparedData
    loader: SFTDataLoader
    generation_rows: list[dict] | None


def train_fields(row: dict) -> dict[str, str]:
    return {
        "loss": f"{row['train/loss']:.4f}",
        "acc": f"{row['sft/token_accuracy']:.3f}",
        "speed": f"{row['train/tokens_per_s']:.0f} tok/s",
        "lr": f"{row['train/lr']:.2e}",
    }


def eval_line(step: int, metrics: dict) -> str:
    return (
        f"eval {step:5d} | loss {metrics['eval/loss']:.4f} | acc {metrics['eval/token_accuracy']:.3f} "
        f"| ppl {metrics['eval/perplexity']:.3f}"
    )


def data_line(cfg: SFTConfig, prepared: PreparedData) -> str:
    data, counts = prepared.data, prepared.data.metrics
    truncated = counts["data/train_truncated"] + counts.get("data/eval_truncated", 0)
    dropped = counts["data/train_dropped"] + counts.get("data/eval_dropped", 0)
    return (
        f"data: {len(data.train)} train / {len(data.eval or [])} eval examples; longer than "
        f"max_seq_len={cfg.data.max_seq_len}: {truncated} truncated, {dropped} dropped"
    )


def run_checkpointer(cfg: SFTConfig) -> RunCheckpointer:
    return RunCheckpointer(Path(cfg.run_dir) / "checkpoints", cfg.checkpoint.keep)


def tokenizer_source(cfg: SFTConfig) -> tuple[str, str] | None:
    """(where the tokenizer is, the key that said so): ``tokenizer_path``, else the checkpoint's
    directory, which holds its tokenizer."""
    if cfg.tokenizer_path is not None:
        return cfg.tokenizer_path, "tokenizer_path"
    if cfg.trainer.engine.model.hf_path is not None:
        return cfg.trainer.engine.model.hf_path, "trainer.engine.model.hf_path"
    return None


def check_fresh_start(cfg: SFTConfig) -> None:
    """A run that does not resume must not overwrite another run's checkpoints; one that does
    needs an intact checkpoint to resume from (with resume=auto, only when there are any)."""
    run_checkpointer(cfg).check_start(cfg.resume, "run_dir")
    if not cfg.resume:
        check_no_earlier_metrics(Path(cfg.run_dir) / "metrics.jsonl", "run_dir")


def prepare(cfg: SFTConfig) -> SFTStart:
    """The start-up checks and the data, before any process starts: bad input (a file, a column,
    a tokenizer) raises ValueError or OSError saying what and where. Sets the model's vocabulary
    size from the tokenizer where no checkpoint brings its own."""
    check_fresh_start(cfg)
    check_writable_dir(cfg.run_dir, "run_dir")
    prepared = prepare_data(cfg.data, tokenizer_source(cfg), Path(cfg.run_dir))
    loader = build_sft_loader(prepared.config, prepared.data)
    engine = cfg.trainer.engine
    if engine.model.hf_path is None:  # a checkpoint brings its own vocabulary rows
        engine.model.vocab_size = engine.model.vocab_size or len(prepared.tokenizer)
    check_model_section(
        engine.model, "trainer.engine.model", len(prepared.tokenizer), str(prepared.tokenizer_dir)
    )
    generation_rows = None
    if cfg.generation_eval is not None:
        generation_rows = generation_eval_rows(prepared.config, cfg.generation_eval.target_column)[
            : cfg.generation_eval.num_prompts
        ]
    return SFTStart(prepared, loader, generation_rows)


async def resume(checkpoints: RunCheckpointer, trainer, loader: SFTDataLoader, report: Report) -> int:
    """Restores the newest intact checkpoint, if any; returns its step (0 without one)."""
    step = await restore_checkpoint(checkpoints, trainer, loader)
    if step is None:
        report("resume: no checkpoint yet, starting from step 0")
        return 0
    report(f"resume: continuing from the checkpoint of step {step}")
    return step


async def train(cfg: SFTConfig, start: SFTStart, report: Report) -> dict[str, float]:
    """Runs the training loop; returns the last eval metrics (and the greedy exact match)."""
    log_tasks_on_sigusr1()
    prepared, loader = start.prepared, start.loader
    run_dir = Path(cfg.run_dir)
    procs, data = cfg.trainer.procs, prepared.data
    dp_size = cfg.trainer.engine.parallelism.dp_degree(procs)
    eval_batch_size = cfg.eval_batch_size or cfg.data.batch_size
    metrics_path = run_dir / "metrics.jsonl"
    checkpoints = run_checkpointer(cfg)
    try:
        # The trainer's processes get GPUs where this machine has them (one per proc).
        trainer = await TitanTrainer.options(procs=procs, with_gpus=torch.cuda.is_available()).as_actor(
            cfg.trainer.engine, cfg.trainer.loss
        )
        first = await resume(checkpoints, trainer, loader, report) if cfg.resume else 0
        # Before the logger opens the file: the steps after the checkpoint are logged again.
        if first == 0:
            metrics_path.unlink(missing_ok=True)
        else:
            drop_metrics_after(metrics_path, first)
        metric_logger = await get_metric_logger(
            cfg.metrics.model_copy(update={"jsonl_path": str(metrics_path)}), config_to_dict(cfg)
        )
        for key, value in data.metrics.items():
            record_metric(key, value, Reduce.SUM)
        last_eval = {}
        progress = Progress(cfg.max_steps, desc="sft", initial=first, every=cfg.log_every)
        if first == 0 and data.eval is not None:
            last_eval = await evaluate_loss(trainer, data, eval_batch_size, dp_size)
            progress.message(eval_line(0, last_eval))
            await metric_logger.flush(0)

        for step in range(first + 1, cfg.max_steps + 1):
            started = time.perf_counter()
            batch = next(loader)
            await trainer.train_step.route(split_for_ranks(batch, dp_size))
            # Tokens the model read (padding included) per second of batching plus training.
            record_metric("train/tokens_per_s", batch["input_ids"].numel() / (time.perf_counter() - started))
            cursor = loader.state_dict()
            record_metric("data/epoch", cursor["epoch"] + cursor["position"] / len(data.train))
            last = step == cfg.max_steps
            if data.eval is not None and (last or (cfg.eval_every and step % cfg.eval_every == 0)):
                last_eval = await evaluate_loss(trainer, data, eval_batch_size, dp_size)
            if cfg.checkpoint.due(step, last):
                await save_checkpoint(checkpoints, step, trainer, loader)
            row = await metric_logger.flush(step)
            progress.update(step, train_fields(row))
            if "eval/loss" in row:
                progress.message(eval_line(step, row))
        progress.close()

        if cfg.export_dir is not None:
            await export(cfg, trainer, prepared.tokenizer_dir, report)
        if start.generation_rows is not None:
            last_eval["eval/greedy_exact_match"] = generation_eval(cfg, start.generation_rows, report)
            record_metric("eval/greedy_exact_match", last_eval["eval/greedy_exact_match"])
            await metric_logger.flush(max(first, cfg.max_steps))
        return last_eval
    finally:
        await (await get_metric_logger()).close()
        await shutdown()


async def export(cfg: SFTConfig, trainer, tokenizer_dir: Path, report: Report) -> None:
    """The end of the run's export: the Hugging Face model at export_dir; with LoRA the PEFT
    adapter there instead, and the merged model in export_dir/merged if export_merged."""
    export_dir = Path(cfg.export_dir).resolve()
    if cfg.trainer.engine.lora is not None:
        await trainer.export_peft.route(str(export_dir))
        report(f"exported the LoRA adapter (PEFT) to {cfg.export_dir}")
    if cfg.model_export_dir is not None:
        await trainer.export_hf.route(str(cfg.model_export_dir.resolve()), str(tokenizer_dir))
        report(f"exported the model to {cfg.model_export_dir}")


def generation_eval(cfg: SFTConfig, rows: list[dict], report: Report) -> float:
    gen = cfg.generation_eval
    accuracy = greedy_exact_match(cfg.model_export_dir, rows, get_reward_fn(gen.reward_fn), gen.max_tokens)
    report(f"greedy exact match of the export: {accuracy:.3f} on {len(rows)} eval prompts")
    return accuracy
