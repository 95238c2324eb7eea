"""GRPO: continuous rollouts and continuous training, joined by the replay buffer.

python -m apps.grpo.main --config configs/grpo/tiny_cpu.yaml [key=value ...]

    rollout loops (x rollout.threads)            training loop
    ---------------------------------            -------------
    wait: staleness bound allows a rollout       wait: a batch is buffered
    prompts -> Generator (newest weights,        ReplayBuffer.sample -> TitanTrainer.train_step
      at least version T - max_policy_age)       TitanTrainer.push_weights(T+1): snapshot, then
      -> reward -> advantages -> reference         store put in the background -> generators
      -> ReplayBuffer.add                          pick it up before their next request

The staleness bound (forge.staleness) pauses rollouts whose episodes could only go stale;
the training loop waits for nothing but a batch.
"""

from __future__ import annotations

import asyncio
import functools
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
from forge.actors.generator import Generator
from forge.actors.reference import ReferenceModel
from forge.actors.replay_buffer import ReplayBuffer
from forge.actors.reward import RewardActor
from forge.actors.trainer import TitanTrainer
from forge.config import config_to_dict, parse_args, save_config
from forge.controller import get_provisioner, init_provisioner, shutdown, supervision
from forge.data.chat_prompts import PromptRenderer
from forge.data.rewards import get_reward_fn
from forge.envs.turns import TurnRenderer
from forge.observability import Reduce, get_metric_logger, record_metric
from forge.observability.progress import Progress as ProgressDisplay
from forge.observability.rollouts import RolloutRecorder, batches_path
from forge.recipes.grpo_replay import replay_training
from forge.rollout import RolloutCounts, Rollouts, greedy_accuracy, rollout_step, wait_for_room
from forge.runs import RunStopped
from forge.runs.checkpoint import Progress, RolloutPause, RunActors, RunCheckpointer
from forge.runs.checks import check_run_inputs
from forge.runs.faults import wait_for_loops
from forge.runs.guards import SkippedUpdates, starvation_report, wait_for_batch
from forge.staleness import StalenessBound
from forge.weight_sync import resolve_transport


def ensure_warm_start(cfg: GRPOConfig) -> None:
    """Runs the configured SFT recipe when the initial policy directory does not exist yet."""
    if (Path(cfg.policy_path) / "config.json").exists() or cfg.warm_start.sft_config is None:
        return
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


def step_fields(row: dict, accuracy: float | None, step_s: float) -> dict[str, str]:
    """The key numbers of a step, as the progress bar or line shows them ("-": none this step,
    e.g. no rollout finished during it)."""

    def shown(key: str, spec: str, unit: str = "") -> str:
        return f"{row[key]:{spec}}{unit}" if key in row else "-"

    fields = {"reward": shown("rollout/reward", ".3f")}
    if accuracy is not None:
        fields["eval acc"] = f"{accuracy:.3f}"
    fields["policy age"] = shown("buffer/policy_age_mean", ".2f")
    fields["gen"] = shown("generator/tokens_per_s", ".0f", " tok/s")
    fields["sync"] = shown("grpo/weight_sync_ms", ".0f", " ms")
    fields["wait"] = shown("grpo/wait_batch_ms", ".0f", " ms")
    fields["step"] = f"{step_s:.2f} s"
    return fields


async def run(cfg: GRPOConfig) -> dict:
    torch.manual_seed(cfg.seed)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    if cfg.actor_threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(cfg.actor_threads)  # before any actor process starts
    await init_provisioner(cfg.provisioner, seed=cfg.seed)
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
    if cfg.metrics.rollouts_path:
        recorder = RolloutRecorder(cfg.metrics.rollouts_path, cfg.metrics.rollouts_every)
    pad_id = _pad_id(cfg)
    transport = resolve_transport(cfg.generator.weight_transport, one_host=not cfg.provisioner.hosts)
    gpus = torch.cuda.is_available()  # model actors each get their own GPUs when there are any
    generators = Generator.options(with_gpus=gpus, num_replicas=cfg.generator.replicas)
    generator_cfg = cfg.generator.model_copy(update={"weight_transport": transport})
    env_actors = EnvironmentActor.options(num_replicas=cfg.env.replicas) if cfg.env else None
    dataset, generator, envs, trainer, replay_buffer, reward, advantages, reference = await asyncio.gather(
        DatasetActor.as_actor(cfg.dataset),
        generators.as_service(generator_cfg)
        if cfg.generator.replicas > 1
        else generators.as_actor(generator_cfg),
        (env_actors.as_service if cfg.env.replicas > 1 else env_actors.as_actor)(cfg.env.name, cfg.env.params)
        if cfg.env
        else asyncio.sleep(0),
        TitanTrainer.options(
            procs=cfg.trainer.procs, hosts=cfg.trainer.hosts, with_gpus=gpus, gpu_group="trainer"
        ).as_actor(
            cfg.trainer.engine,
            cfg.trainer.loss,
            weights_dtype=cfg.generator.dtype,
            keep_weight_versions=cfg.keep_weight_versions,
            weight_transport=transport,
            verify_weights=cfg.generator.verify_weights,
        )
        if cfg.trainer.enabled
        else asyncio.sleep(0),
        ReplayBuffer.as_actor(
            cfg.replay_buffer, pad_id, cfg.dp_size, str(batches_path(recorder.path)) if recorder else None
        ),
        RewardActor.as_actor(cfg.reward),
        ComputeAdvantages.as_actor(cfg.rollout.advantage),
        # On the trainer's GPU: a KL term needs no GPU of its own.
        ReferenceModel.options(with_gpus=gpus, gpu_group="trainer").as_actor(
            cfg.trainer.engine, cfg.generator.sampling.temperature
        )
        if cfg.use_reference
        else asyncio.sleep(0),
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
    )
    eval_rows = (await dataset.eval_set.call_one())[: cfg.eval.num_prompts]
    score_fn = get_reward_fn(cfg.eval.reward_fn)
    stop = asyncio.Event()
    # Without a trainer the policy never changes, so no episode can grow stale.
    max_age = cfg.replay_buffer.max_policy_age if cfg.trainer.enabled else cfg.max_steps
    bound = StalenessBound(max_age, cfg.replay_buffer.batch_size)
    rollout_episodes = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    counts, skips = RolloutCounts(), SkippedUpdates(cfg.trainer.max_skipped_updates)
    checkpoints, actors = checkpointer(cfg), RunActors(trainer, replay_buffer, dataset, generator)
    pause = RolloutPause()

    async def continuous_rollouts() -> None:
        """Waits for the staleness bound to allow a rollout, then makes one into the buffer."""
        while not stop.is_set():
            await wait_for_room(replay_buffer, counts, lambda: bound.version)
            min_version = await bound.start_rollout(rollout_episodes)
            added: list[int] = []
            try:
                async with pause.rollout():  # a checkpoint holds new rollouts (see RolloutPause)
                    added = await rollout_step(
                        dataset=dataset,
                        rollouts=rollouts,
                        reward=reward,
                        advantages=advantages,
                        reference=reference,
                        replay_buffer=replay_buffer,
                        prompts_per_step=cfg.rollout.prompts_per_step,
                        group_size=cfg.rollout.group_size,
                        skip_groups_without_signal=cfg.rollout.skip_groups_without_signal,
                        min_version=min_version,
                        counts=counts,
                        recorder=recorder,
                    )
            finally:
                await bound.finish_rollout(rollout_episodes, added)

    async def next_batch(version: int):
        await bound.wait_for_batch()
        # The bound mirrors the buffer, so the first sample normally has a batch.
        while (batch := await replay_buffer.sample.call_one(version)) is None:
            await asyncio.sleep(0.05)
        return batch

    explain_starvation = functools.partial(
        starvation_report, counts, replay_buffer, reward, cfg.replay_buffer
    )

    async def evaluate(version: int) -> float:
        return await greedy_accuracy(rollouts, eval_rows, score_fn, cfg.eval.max_tokens, version, recorder)

    async def continuous_training(progress: Progress) -> dict:
        """Waits only for a batch; publishing the new weights overlaps the next step."""
        history = progress.history
        display = ProgressDisplay(cfg.max_steps, desc="grpo", initial=progress.step)
        if progress.step == 0:
            accuracy = await evaluate(0)
            record_metric("eval/accuracy", accuracy, Reduce.MEAN)
            await metric_logger.flush(0)
            history["eval_accuracy"].append((0, accuracy))
            display.message(f"step 0 | eval acc {accuracy:.3f} (initial policy)")
        version = progress.version
        for step in range(progress.step + 1, cfg.max_steps + 1):
            started = time.perf_counter()
            if recorder is not None:
                recorder.step = step
            batch = await wait_for_batch(
                next_batch(version), cfg.replay_buffer.starve_timeout_s, explain_starvation
            )
            record_metric("grpo/wait_batch_ms", (time.perf_counter() - started) * 1e3, Reduce.MEAN)
            episode_versions = [int(v) for b in batch for v in b.policy_versions]
            if trainer is not None:  # trainer.enabled=false: only generate and record
                skips.observe(step, next(iter((await trainer.train_step.call(batch)).values())))
                version += 1
                sync_started = time.perf_counter()
                await trainer.push_weights.call(version)
                record_metric("grpo/weight_sync_ms", (time.perf_counter() - sync_started) * 1e3, Reduce.MEAN)
                record_metric("grpo/trained_policy_age_max", version - 1 - min(episode_versions), Reduce.MAX)
            await bound.trained(episode_versions)
            accuracy = None
            if cfg.eval.every and (step % cfg.eval.every == 0 or step == cfg.max_steps):
                accuracy = await evaluate(version)
                record_metric("eval/accuracy", accuracy, Reduce.MEAN)
                history["eval_accuracy"].append((step, accuracy))
            record_metric("grpo/step_s", time.perf_counter() - started, Reduce.MEAN)
            row = await metric_logger.flush(step)
            display.update(
                step, step_fields(row, accuracy, time.perf_counter() - started), persist=accuracy is not None
            )
            if trainer is None:
                continue
            every, last = cfg.checkpoint.every, step == cfg.max_steps
            if every and (step % every == 0 or last):
                async with pause.paused():
                    await checkpoints.save(Progress(step, version, history), actors)
            if last or (cfg.checkpoint.export_every and step % cfg.checkpoint.export_every == 0):
                await trainer.export_hf.call(
                    str(Path(cfg.output_dir, "export").resolve()),
                    cfg.policy_path,
                    cfg.checkpoint.export_dtype,
                )
        display.close()
        if trainer is not None:
            await trainer.wait_published.call()
        return history

    progress = Progress()
    if cfg.resume:
        progress = await checkpoints.resume(actors, trainer.push_weights.call, cfg.metrics.jsonl_path)
        bound.restore(progress.version, progress.buffered_versions)
        print(
            f"resume: continuing after step {progress.step}" if progress.step else "resume: no checkpoint yet"
        )
    rollout_loops = [asyncio.create_task(continuous_rollouts()) for _ in range(cfg.rollout.threads)]
    training = asyncio.create_task(continuous_training(progress))
    try:
        history = await wait_for_loops(training, rollout_loops)
    finally:
        # Also on Ctrl-C (asyncio cancels this coroutine): stop both loops before the actors.
        stop.set()
        for task in (training, *rollout_loops):
            task.cancel()
        await asyncio.gather(training, *rollout_loops, return_exceptions=True)
        await metric_logger.close()
        await store.shutdown()
        if recorder is not None:
            recorder.close()
    return history


def stopped(cfg: GRPOConfig, reason: str) -> NoReturn:
    """Exit 1 for a run that stopped on a failure, saying where it can be resumed from."""
    latest = checkpointer(cfg).latest()
    where = f"newest checkpoint: {latest} (continue with resume=true)" if latest else "no checkpoint yet"
    print(f"error: {reason}\n{where}", file=sys.stderr)
    raise SystemExit(1)


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = parse_args(GRPOConfig, argv, description="GRPO training with forge")
    ensure_warm_start(cfg)
    try:
        if cfg.rollout.replay_from and not Path(cfg.rollout.replay_from).is_file():
            raise FileNotFoundError(f"rollout.replay_from: no rollout records at {cfg.rollout.replay_from}")
        check_run_inputs(cfg)
        checkpointer(cfg).check_start(cfg.resume)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    started = time.perf_counter()
    try:
        history = asyncio.run(run(cfg))
    except KeyboardInterrupt:
        print("interrupted: actors stopped", file=sys.stderr)
        raise SystemExit(130) from None
    except RunStopped as e:
        stopped(cfg, str(e))
    except supervision.FAILURES as e:
        stopped(cfg, supervision.explain(e))
    summary = f"done in {time.perf_counter() - started:.0f} s"
    if history["eval_accuracy"]:
        (first_step, first), (last_step, last) = history["eval_accuracy"][0], history["eval_accuracy"][-1]
        summary += f": eval accuracy {first:.3f} (step {first_step}) -> {last:.3f} (step {last_step})"
    print(summary)
    return history


if __name__ == "__main__":
    main()
