"""GRPO: continuous rollouts and continuous training, joined by the replay buffer.

python -m apps.grpo.main --config configs/grpo/tiny_cpu.yaml [key=value ...]

This app is wiring: it parses the config, trains the warm start if there is none, checks the
run's inputs and runs it (forge.grpo.run: the actors, one launch per section, handed to the loops
in forge.runs.grpo_loops, where the pipeline is drawn).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import NoReturn

from forge.config import parse_args
from forge.config.errors import ConfigError
from forge.controller import supervision
from forge.grpo.config import GRPOConfig
from forge.grpo.run import check_start, checkpointer, run
from forge.grpo.warm_start import ensure_warm_start
from forge.runs import ActorFailed, RunStopped
from forge.runs.restarts import ACTOR_FAILED_EXIT, run_with_restarts


def stopped(cfg: GRPOConfig, reason: str, code: int = 1) -> NoReturn:
    """Exit for a run that stopped before its end, saying where it can be resumed from."""
    latest = checkpointer(cfg).latest()
    where = f"newest checkpoint: {latest} (continue with resume=true)" if latest else "no checkpoint yet"
    print(f"{reason}\n{where}", file=sys.stderr)
    raise SystemExit(code)


def summary(history: dict, seconds: float) -> str:
    text = f"done in {seconds:.0f} s"
    if history["eval_accuracy"]:
        (first_step, first), (last_step, last) = history["eval_accuracy"][0], history["eval_accuracy"][-1]
        text += f": eval accuracy {first:.3f} (step {first_step}) -> {last:.3f} (step {last_step})"
    return text


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = parse_args(GRPOConfig, argv, description="GRPO training with forge")
    try:
        ensure_warm_start(cfg, print)
        plan = check_start(cfg)
    except (FileNotFoundError, ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if cfg.max_restarts:  # this process supervises; the pipeline runs in a child
        arguments = sys.argv[1:] if argv is None else argv
        code = run_with_restarts(
            "apps.grpo.main", arguments, cfg.max_restarts, cfg.restart_backoff_s, checkpointer(cfg).latest
        )
        raise SystemExit(code)
    started = time.perf_counter()
    try:
        history = asyncio.run(run(cfg, plan, print))
    except KeyboardInterrupt:
        stopped(cfg, "interrupted: actors stopped", code=130)
    except ActorFailed as e:
        stopped(cfg, f"error: {e}", code=ACTOR_FAILED_EXIT)
    except RunStopped as e:
        stopped(cfg, f"error: {e}")
    except supervision.FAILURES as e:
        stopped(cfg, f"error: {supervision.explain(e)}", code=ACTOR_FAILED_EXIT)
    print(summary(history, time.perf_counter() - started))
    return history


if __name__ == "__main__":
    main()
