"""GRPO: continuous rollouts and continuous training, joined by the replay buffer.

python -m apps.grpo.main --config configs/grpo/tiny_cpu.yaml [key=value ...]

This app is wiring: it checks the config, launches the actors and hands them to the loops in
forge.runs.grpo_loops (where the pipeline is drawn).
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

import torch

from apps.grpo.config import GRPOConfig
from forge import store
from forge.actors.advantages import ComputeAdvantages
from forge.actors.dataset import DatasetActor
from forge.actors.environment import EnvironmentActor
from forge.actors.generator import Generator, stop_pulling
from forge.actors.reference import ReferenceModel
from forge.actors.replay_buffer import ReplayBuffer
from forge.actors.reward import RewardActor
from forge.actors.reward_models import launch_reward_models
from forge.actors.trainer import TitanTrainer
from forge.config import config_to_dict, parse_args, save_config
from forge.config.errors import ConfigError
from forge.controller import get_provisioner, init_provisioner, shutdown, supervision
from forge.controller.gpu_plan import GENERATOR_GROUP, TRAINER_GROUP, GpuPlan
from forge.controller.provisioner import visible_gpus
from forge.data.chat_prompts import PromptRenderer
from forge.envs.turns import TurnRenderer
from forge.observability import get_metric_logger
from forge.recipes.grpo_replay import replay_training
from forge.rewards.scorer import RewardScorer
from forge.rollout.records import RolloutRecorder, batches_path
from forge.rollout.step import Rollouts
from forge.runs import ActorFailed, RunStopped
from forge.runs.checkpoint import Progress, RunCheckpointer
from forge.runs.checks import check_no_earlier_metrics, check_run_inputs
from forge.runs.grpo_loops import GRPOActors, GRPOLoops
from forge.runs.placement import grpo_gpu_plan
from forge.runs.restarts import ACTOR_FAILED_EXIT, run_with_restarts, starts_afresh
from forge.weight_sync import resolve_transport


def ensure_warm_start(cfg: GRPOConfig) -> None:
    """Runs the configured SFT recipe when the initial policy directory does not exist yet,
    provided that the recipe exports to exactly that directory (a misspelled policy_path must
    not retrain and re-export over the warm start that is there)."""
    if (Path(cfg.policy_path) / "config.json").exists() or cfg.warm_start.sft_config is None:
        return
    from apps.sft.config import SFTConfig
    from forge.config import load_config

    sft = load_config(SFTConfig, cfg.warm_start.sft_config, cfg.warm_start.sft_overrides)
    if sft.export_dir is None or Path(sft.export_dir).resolve() != Path(cfg.policy_path).resolve():
        raise ValueError(
            f"policy_path: no model at {cfg.policy_path}, and the warm start ({cfg.warm_start.sft_config}) "
            f"exports to {sft.export_dir}, not there: fix policy_path, or point warm_start at an SFT "
            "config that exports to it"
        )
    print(f"no initial policy at {cfg.policy_path}: training it with SFT ({cfg.warm_start.sft_config}) first")
    command = [
        sys.executable,
        "-m",
        "apps.sft.main",
        "--config",
        cfg.warm_start.sft_config,
        *cfg.warm_start.sft_overrides,
    ]
    subprocess.run(command, check=True)


def checkpointer(cfg: GRPOConfig) -> RunCheckpointer:
    return RunCheckpointer(Path(cfg.output_dir) / "checkpoints", cfg.checkpoint.keep)


async def run(cfg: GRPOConfig, plan: GpuPlan | None = None) -> dict:
    """The run; `plan` places its model actors on this host's GPUs (`forge.runs.placement`)."""
    torch.manual_seed(cfg.seed)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    if cfg.actor_threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(cfg.actor_threads)  # before any actor process starts
    if plan is not None:
        print(plan.describe(visible_gpus()))
    await init_provisioner(cfg.provisioner, seed=cfg.seed, plan=plan)
    try:
        if cfg.rollout.replay_from:
            return await _replay(cfg)
        return await _train(cfg)
    finally:
        await shutdown()


def _pad_id(cfg: GRPOConfig) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.policy_path).pad_token_id or 0


def _turn_renderer(cfg: GRPOConfig) -> TurnRenderer:
    """The chat template of the generator's tokenizer, for opening prompts and environment turns."""
    from transformers import AutoTokenizer

    prompts = PromptRenderer(
        AutoTokenizer.from_pretrained(cfg.generator.model_path), cfg.dataset.chat_template
    )
    return TurnRenderer(prompts, cfg.generator.sampling.stop_token_ids)


async def _replay(cfg: GRPOConfig) -> dict:
    """Train-only debugging: the recorded run's batches, with no generator, reward or reference."""
    steps = await replay_training(
        cfg.rollout.replay_from,
        trainer_engine=cfg.trainer.engine,
        trainer_loss=cfg.trainer.loss,
        trainer_procs=cfg.trainer.procs,
        dp_size=cfg.dp_size,
        pad_id=_pad_id(cfg),
        max_steps=cfg.max_steps,
        metrics=cfg.metrics,
        run_config=config_to_dict(cfg),
    )
    return {"eval_accuracy": [], "replayed_steps": steps}


async def _train(cfg: GRPOConfig) -> dict:
    metric_logger = await get_metric_logger(cfg.metrics, config_to_dict(cfg))
    await store.initialize()
    recorder = None
    # The eval's reward runs contained like the training rewards: a call that raises or hangs
    # scores 0 (not solved) and is counted in eval/reward/<name>/errors|timeouts.
    eval_scorer = RewardScorer(
        [(cfg.eval.reward_fn, 1.0)],
        timeout_s=cfg.reward.timeout_s,
        memory_limit_gib=cfg.reward.memory_limit_gib,
        metric_prefix="eval/reward",
    )
    generator = None
    try:  # from here on the store and the logger are released however start-up ends
        if cfg.metrics.rollouts_path:
            recorder = RolloutRecorder(cfg.metrics.rollouts_path, cfg.metrics.rollouts_every)
        pad_id = _pad_id(cfg)
        transport = resolve_transport(cfg.generator.weight_transport, one_host=not cfg.provisioner.hosts)
        gpus = torch.cuda.is_available()  # model actors each get their own GPUs when there are any
        generators = Generator.options(
            with_gpus=gpus, num_replicas=cfg.generator.replicas, gpu_group=GENERATOR_GROUP
        )
        generator_cfg = cfg.generator.model_copy(update={"weight_transport": transport})
        env_actors = EnvironmentActor.options(num_replicas=cfg.env.replicas) if cfg.env else None
        (
            dataset,
            generator,
            envs,
            trainer,
            replay_buffer,
            reward,
            advantages,
            reference,
            reward_models,
            _,
        ) = await asyncio.gather(
            DatasetActor.as_actor(cfg.dataset),
            generators.as_service(generator_cfg, probe=cfg.generator.probe)
            if cfg.generator.replicas > 1
            else generators.as_actor(generator_cfg),
            (env_actors.as_service if cfg.env.replicas > 1 else env_actors.as_actor)(
                cfg.env.name, cfg.env.params
            )
            if cfg.env
            else asyncio.sleep(0),
            TitanTrainer.options(
                procs=cfg.trainer.procs, hosts=cfg.trainer.hosts, with_gpus=gpus, gpu_group=TRAINER_GROUP
            ).as_actor(
                cfg.trainer.engine,
                cfg.trainer.loss,
                weights_dtype=cfg.generator.dtype,
                keep_weight_versions=cfg.keep_weight_versions,
                weight_transport=transport,
                verify_weights=cfg.generator.verify_weights,
                profile_step=cfg.trainer.profile_step,
                profile_dir=f"{cfg.output_dir}/profile",
            )
            if cfg.trainer.enabled
            else asyncio.sleep(0),
            ReplayBuffer.as_actor(
                cfg.replay_buffer, pad_id, cfg.dp_size, str(batches_path(recorder.path)) if recorder else None
            ),
            RewardActor.as_actor(cfg.reward),
            ComputeAdvantages.as_actor(cfg.rollout.advantage),
            # With the trainer's processes, hosts, GPUs and parallelism: a KL term needs no GPU
            # of its own, and each GPU holds a shard of the reference as it does of the policy.
            ReferenceModel.options(
                procs=cfg.trainer.procs, hosts=cfg.trainer.hosts, with_gpus=gpus, gpu_group=TRAINER_GROUP
            ).as_actor(cfg.trainer.engine, cfg.generator.sampling.temperature)
            if cfg.use_reference
            else asyncio.sleep(0),
            launch_reward_models(cfg.reward, gpus),
            asyncio.to_thread(eval_scorer.start),  # not on the initial eval's time
        )
        if cfg.provisioner.hosts:
            print((await get_provisioner()).report_placement(Path(cfg.output_dir) / "placement.json"))
        rollouts = Rollouts(
            generator,
            _turn_renderer(cfg),
            cfg.generator.sampling.max_tokens,
            envs,
            cfg.trajectory_limits,
            drop_truncated=cfg.env is not None and cfg.env.on_truncation == "drop",
            deadline=cfg.generator.deadline,
        )
        eval_rows = (await dataset.eval_set.route())[: cfg.eval.num_prompts]
        actors = GRPOActors(
            dataset, rollouts, trainer, replay_buffer, reward, advantages, reference, reward_models
        )
        loops = GRPOLoops(
            cfg,
            actors,
            eval_rows,
            eval_scorer,
            metric_logger,
            checkpointer(cfg),
            recorder,
        )
        progress = Progress()
        if cfg.resume:
            progress = await loops.resume()
            print(
                f"resume: continuing after step {progress.step}"
                if progress.step
                else "resume: no checkpoint yet"
            )
        return await loops.run(progress)
    finally:
        await metric_logger.close()
        if generator is not None:  # no generator is waiting on the store when it stops
            await stop_pulling(generator)
        await (await get_provisioner()).stop_supervisors()  # no replica is replaced any more
        await store.shutdown()
        eval_scorer.close()
        if recorder is not None:
            recorder.close()


def stopped(cfg: GRPOConfig, reason: str, code: int = 1) -> NoReturn:
    """Exit for a run that stopped before its end, saying where it can be resumed from."""
    latest = checkpointer(cfg).latest()
    where = f"newest checkpoint: {latest} (continue with resume=true)" if latest else "no checkpoint yet"
    print(f"{reason}\n{where}", file=sys.stderr)
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> dict:
    from transformers import AutoTokenizer

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = parse_args(GRPOConfig, argv, description="GRPO training with forge")
    try:
        ensure_warm_start(cfg)
        if cfg.rollout.replay_from and not Path(cfg.rollout.replay_from).is_file():
            raise FileNotFoundError(f"rollout.replay_from: no rollout records at {cfg.rollout.replay_from}")
        check_run_inputs(cfg)
        # The trainer and the reference score the ids the generator samples, those its tokenizer
        # decodes (a checkpoint may have more vocabulary rows).
        cfg.trainer.engine.model.sampled_rows = len(AutoTokenizer.from_pretrained(cfg.generator.model_path))
        checkpoints = checkpointer(cfg)
        checkpoints.check_start(cfg.resume)
        plan = grpo_gpu_plan(cfg, visible_gpus() if torch.cuda.is_available() else [])
        if starts_afresh(cfg.resume, checkpoints.latest() is not None):
            check_no_earlier_metrics(cfg.metrics.jsonl_path, "metrics.jsonl_path")
    except (FileNotFoundError, ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if cfg.max_restarts:  # this process supervises; the pipeline runs in a child
        arguments = sys.argv[1:] if argv is None else argv
        code = run_with_restarts(
            "apps.grpo.main", arguments, cfg.max_restarts, cfg.restart_backoff_s, checkpoints.latest
        )
        raise SystemExit(code)
    started = time.perf_counter()
    try:
        history = asyncio.run(run(cfg, plan))
    except KeyboardInterrupt:
        stopped(cfg, "interrupted: actors stopped", code=130)
    except ActorFailed as e:
        stopped(cfg, f"error: {e}", code=ACTOR_FAILED_EXIT)
    except RunStopped as e:
        stopped(cfg, f"error: {e}")
    except supervision.FAILURES as e:
        stopped(cfg, f"error: {supervision.explain(e)}", code=ACTOR_FAILED_EXIT)
    summary = f"done in {time.perf_counter() - started:.0f} s"
    if history["eval_accuracy"]:
        (first_step, first), (last_step, last) = history["eval_accuracy"][0], history["eval_accuracy"][-1]
        summary += f": eval accuracy {first:.3f} (step {first_step}) -> {last:.3f} (step {last_step})"
    print(summary)
    return history


if __name__ == "__main__":
    main()
