"""SFT: supervised fine-tuning on the TorchTitan engine, with held-out eval, checkpoints and export.

    python -m apps.sft.main --config configs/sft/tiny_cpu.yaml [key=value ...]

The controller (this process) reads and batches the data; the `TitanTrainer` actor (one proc
mesh, `trainer.procs` data-parallel ranks) trains. Outputs, all under `run_dir`: metrics.jsonl,
config.yaml, checkpoints/step_XXXXXXXX (run checkpoints, as GRPO's: model, optimizer, LR schedule,
step, data position, RNG; forge.runs.checkpoint), and the Hugging Face export at `export_dir`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from pathlib import Path

import datasets
import torch
import transformers

from forge.actors.trainer import TitanTrainer
from forge.config import config_to_dict, parse_args, save_config
from forge.controller import shutdown
from forge.data.prompts import read_prompt_target_rows
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
from forge.sft.batches import SFTDataLoader
from forge.sft.config import SFTConfig
from forge.sft.dataset import build_sft_loader


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


async def resume(checkpoints: RunCheckpointer, trainer, loader: SFTDataLoader) -> int:
    """Restores the newest intact checkpoint, if any; returns its step (0 without one)."""
    step = await restore_checkpoint(checkpoints, trainer, loader)
    if step is None:
        print("resume: no checkpoint yet, starting from step 0")
        return 0
    print(f"resume: continuing from the checkpoint of step {step}")
    return step


async def train(
    cfg: SFTConfig, prepared: PreparedData, loader: SFTDataLoader, generation_rows: list[dict] | None
) -> dict[str, float]:
    """Runs the training loop; returns the last eval metrics (and the greedy exact match)."""
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
        start = await resume(checkpoints, trainer, loader) if cfg.resume else 0
        # Before the logger opens the file: the steps after the checkpoint are logged again.
        if start == 0:
            metrics_path.unlink(missing_ok=True)
        else:
            drop_metrics_after(metrics_path, start)
        metric_logger = await get_metric_logger(
            cfg.metrics.model_copy(update={"jsonl_path": str(metrics_path)}), config_to_dict(cfg)
        )
        for key, value in data.metrics.items():
            record_metric(key, value, Reduce.SUM)
        last_eval = {}
        progress = Progress(cfg.max_steps, desc="sft", initial=start, every=cfg.log_every)
        if start == 0 and data.eval is not None:
            last_eval = await evaluate_loss(trainer, data, eval_batch_size, dp_size)
            progress.message(eval_line(0, last_eval))
            await metric_logger.flush(0)

        for step in range(start + 1, cfg.max_steps + 1):
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
            await trainer.export_hf.route(str(Path(cfg.export_dir).resolve()), str(prepared.tokenizer_dir))
            print(f"exported the model to {cfg.export_dir}", flush=True)
        if generation_rows is not None:
            last_eval["eval/greedy_exact_match"] = generation_eval(cfg, generation_rows)
            record_metric("eval/greedy_exact_match", last_eval["eval/greedy_exact_match"])
            await metric_logger.flush(max(start, cfg.max_steps))
        return last_eval
    finally:
        await (await get_metric_logger()).close()
        await shutdown()


def generation_eval(cfg: SFTConfig, rows: list[dict]) -> float:
    gen = cfg.generation_eval
    accuracy = greedy_exact_match(cfg.export_dir, rows, get_reward_fn(gen.reward_fn), gen.max_tokens)
    print(f"greedy exact match of the export: {accuracy:.3f} on {len(rows)} eval prompts", flush=True)
    return accuracy


def main(argv: list[str] | None = None) -> dict[str, float]:
    # force: importing torchstore (through forge.store) sets the root logger to INFO.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", force=True)
    # The progress lines below are the app's output; library progress bars would interleave.
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    cfg = parse_args(SFTConfig, argv, description="Supervised fine-tuning with forge")
    started = time.perf_counter()
    # Inherited by the trainer processes, which start after this.
    threads = cfg.trainer.threads or max(1, (os.cpu_count() or 1) // cfg.trainer.procs)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    engine = cfg.trainer.engine
    try:
        check_fresh_start(cfg)
        check_writable_dir(cfg.run_dir, "run_dir")
        prepared = prepare_data(cfg.data, tokenizer_source(cfg), Path(cfg.run_dir))
        loader = build_sft_loader(prepared.config, prepared.data)
        if engine.model.hf_path is None:  # a checkpoint brings its own vocabulary rows
            engine.model.vocab_size = engine.model.vocab_size or len(prepared.tokenizer)
        check_model_section(
            engine.model, "trainer.engine.model", len(prepared.tokenizer), str(prepared.tokenizer_dir)
        )
        generation_rows = None
        if cfg.generation_eval is not None:
            generation_rows = read_prompt_target_rows(
                prepared.config.eval_path,
                cfg.data.prompt_column,
                cfg.generation_eval.target_column,
                "data.prompt_column / generation_eval.target_column, which generation_eval reads",
            )[: cfg.generation_eval.num_prompts]
    except (ValueError, OSError) as error:
        # Bad input (a file, a column, a tokenizer): the message says what and where.
        print(f"sft: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    save_config(cfg, Path(cfg.run_dir) / "config.yaml")
    print(data_line(cfg, prepared), flush=True)
    try:
        final = asyncio.run(train(cfg, prepared, loader, generation_rows))
    except KeyboardInterrupt:
        latest = run_checkpointer(cfg).latest()
        where = f"newest checkpoint: {latest} (continue with resume=true)" if latest else "no checkpoint yet"
        print(f"interrupted: actors stopped\n{where}", file=sys.stderr)
        raise SystemExit(130) from None
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)
    return final


if __name__ == "__main__":
    main()
