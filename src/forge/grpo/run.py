"""A GRPO run in this process: its start-up checks, then the actors (`forge.grpo.launch`) and the
loops (`forge.runs.grpo_loops`), or train-only replay (`forge.recipes.grpo_replay`).

What the run tells its user (its GPU plan, where its hosts' actors went, where it resumes) goes
to `report`, which the app prints.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoTokenizer

from forge import store
from forge.actors.generator import stop_pulling
from forge.config import config_to_dict, save_config
from forge.controller import get_provisioner, init_provisioner, shutdown
from forge.controller.gpu_plan import GpuPlan
from forge.controller.provisioner import visible_gpus
from forge.grpo.config import GRPOConfig
from forge.grpo.launch import launch_actors, pad_id
from forge.observability import get_metric_logger
from forge.recipes.grpo_replay import replay_training
from forge.rewards.scorer import RewardScorer
from forge.rewards.sources import RewardFunctions, RolloutScorer
from forge.rollout.records import RolloutRecorder
from forge.runs.checkpoint import Progress, RunCheckpointer
from forge.runs.checks import check_no_earlier_metrics, check_run_inputs
from forge.runs.grpo_loops import GRPOLoops
from forge.runs.placement import check_kv_cache, grpo_gpu_plan, idle_replicas_line, kv_cache_line
from forge.runs.restarts import starts_afresh
from forge.runs.storage import stop_on_storage_errors
from forge.runs.task_dump import log_tasks_on_sigusr1

Report = Callable[[str], None]


def checkpointer(cfg: GRPOConfig) -> RunCheckpointer:
    return RunCheckpointer(Path(cfg.output_dir) / "checkpoints", cfg.checkpoint.keep)


def check_start(cfg: GRPOConfig) -> GpuPlan | None:
    """Every check before any process starts (each raises with what to fix); returns where the
    model actors go on this host's GPUs (None without GPUs)."""
    if cfg.rollout.replay_from and not Path(cfg.rollout.replay_from).is_file():
        raise FileNotFoundError(f"rollout.replay_from: no rollout records at {cfg.rollout.replay_from}")
    check_run_inputs(cfg)
    checkpoints = checkpointer(cfg)
    checkpoints.check_start(cfg.resume)
    check_kv_cache(cfg, torch.cuda.is_available())
    plan = grpo_gpu_plan(cfg, visible_gpus() if torch.cuda.is_available() else [])
    if starts_afresh(cfg.resume, checkpoints.latest() is not None):
        check_no_earlier_metrics(cfg.metrics.jsonl_path, "metrics.jsonl_path")
    return plan


async def run(cfg: GRPOConfig, plan: GpuPlan | None, report: Report) -> dict:
    """The run; `plan` places its model actors on this host's GPUs (`forge.runs.placement`)."""
    log_tasks_on_sigusr1()
    torch.manual_seed(cfg.seed)
    # The generator's tokenizer, loaded once: it renders the prompts, pads the batches, and says
    # which ids the trainer and the reference score, those the generator samples (a checkpoint
    # may have more vocabulary rows).
    tokenizer = AutoTokenizer.from_pretrained(cfg.generator.model_path)
    cfg.trainer.engine.model.sampled_rows = len(tokenizer)
    # A full or read-only disk met anywhere in this process (the config, metric and record
    # files, a checkpoint) stops the run naming the file, for the app to say where to resume.
    with stop_on_storage_errors(cfg.output_dir):
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
        if cfg.actor_threads is not None:
            os.environ["OMP_NUM_THREADS"] = str(cfg.actor_threads)  # before any actor process starts
        if plan is not None:
            report(plan.describe(visible_gpus()))
        if not cfg.rollout.replay_from:
            on_gpu = torch.cuda.is_available()
            for line in (kv_cache_line(cfg, on_gpu), idle_replicas_line(cfg, on_gpu)):
                if line is not None:
                    report(line)
        await init_provisioner(cfg.provisioner, seed=cfg.seed, plan=plan)
        try:
            if cfg.rollout.replay_from:
                return await _replay(cfg, pad_id(tokenizer))
            return await _train(cfg, report, tokenizer)
        finally:
            await shutdown()


async def _replay(cfg: GRPOConfig, pad: int) -> dict:
    """Train-only debugging: the recorded run's batches, with no generator, reward or reference."""
    steps = await replay_training(
        cfg.rollout.replay_from,
        trainer_engine=cfg.trainer.engine,
        trainer_loss=cfg.trainer.loss,
        trainer_procs=cfg.trainer.procs,
        dp_size=cfg.dp_size,
        pad_id=pad,
        max_steps=cfg.max_steps,
        metrics=cfg.metrics,
        run_config=config_to_dict(cfg),
    )
    return {"eval_accuracy": [], "replayed_steps": steps}


async def _train(cfg: GRPOConfig, report: Report, tokenizer) -> dict:
    metric_logger = await get_metric_logger(cfg.metrics, config_to_dict(cfg))
    await store.initialize()
    # The eval's reward runs contained like the training rewards: a call that raises or hangs
    # scores 0 (not solved) and is counted in eval/reward/<name>/errors|timeouts. Its worker
    # runs in this process (`eval_functions`), scored through the rollouts' kind of scorer.
    eval_functions = RewardScorer(
        [(cfg.eval.reward_fn, 1.0)],
        timeout_s=cfg.reward.timeout_s,
        memory_limit_gib=cfg.reward.memory_limit_gib,
    )
    eval_scorer = RolloutScorer(
        [RewardFunctions.in_process(eval_functions)],
        metric_prefix="eval/reward",
    )
    generator = agent = None
    try:  # from here on the store and the logger are released however start-up ends
        recorder = (
            RolloutRecorder(cfg.metrics.rollouts_path, cfg.metrics.rollouts_every)
            if cfg.metrics.rollouts_path
            else None
        )
        # Closed when the loops have stopped: a failure to write the last records stops a run
        # that ended well, and never hides the error a run stopped with (RolloutRecorder.__exit__).
        with recorder or contextlib.nullcontext():
            actors = await launch_actors(cfg, recorder, eval_functions, tokenizer)
            generator, agent = actors.rollouts.generator, actors.rollouts.agent
            if cfg.provisioner.hosts:
                report((await get_provisioner()).report_placement(Path(cfg.output_dir) / "placement.json"))
            eval_rows = (await actors.dataset.eval_set.route())[: cfg.eval.num_prompts]
            loops = GRPOLoops(cfg, actors, eval_rows, eval_scorer, metric_logger, checkpointer(cfg), recorder)
            progress = Progress()
            if cfg.resume:
                progress = await loops.resume()
                report(
                    f"resume: continuing after step {progress.step}"
                    if progress.step
                    else "resume: no checkpoint yet"
                )
            return await loops.run(progress)
    finally:
        await metric_logger.close()
        if agent is not None:
            await agent.close()
        if generator is not None:  # no generator is waiting on the store when it stops
            await stop_pulling(generator)
        await (await get_provisioner()).stop_supervisors()  # no replica is replaced any more
        await store.shutdown()
        eval_functions.close()
