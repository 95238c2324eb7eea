"""SFT: supervised fine-tuning on the TorchTitan engine, with held-out eval, checkpoints and export.

    python -m apps.sft.main --config configs/sft/tiny_cpu.yaml [key=value ...]

The controller (this process) reads and batches the data; the `TitanTrainer` actor (one proc
mesh, `trainer.procs` data-parallel ranks) trains (forge.recipes.sft_run). Outputs, all under
`run_dir`: metrics.jsonl, config.yaml, checkpoints/step_XXXXXXXX (run checkpoints, as GRPO's:
model, optimizer, LR schedule, step, data position, RNG; forge.runs.checkpoint), and the Hugging
Face export at `export_dir` (with LoRA: the PEFT adapter, and the merged model on request).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from pathlib import Path

import datasets
import transformers

from forge.config import parse_args, save_config
from forge.recipes.sft_run import data_line, prepare, run_checkpointer, train
from forge.sft.config import SFTConfig


def say(text: str) -> None:
    print(text, flush=True)


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
    try:
        start = prepare(cfg)
    except (ValueError, OSError) as error:
        # Bad input (a file, a column, a tokenizer): the message says what and where.
        print(f"sft: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    save_config(cfg, Path(cfg.run_dir) / "config.yaml")
    say(data_line(cfg, start.prepared))
    try:
        final = asyncio.run(train(cfg, start, say))
    except KeyboardInterrupt:
        latest = run_checkpointer(cfg).latest()
        where = f"newest checkpoint: {latest} (continue with resume=true)" if latest else "no checkpoint yet"
        print(f"interrupted: actors stopped\n{where}", file=sys.stderr)
        raise SystemExit(130) from None
    say(f"done in {time.perf_counter() - started:.0f} s")
    return final


if __name__ == "__main__":
    main()
