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
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from apps.grpo.config import GRPOConfig
from forge import store
from forge.actors.advantages import ComputeAdvantages
from forge.actors.dataset import DatasetActor
from forge.actors.generator import Generator
from forge.actors.reference import ReferenceModel
from forge.actors.replay_buffer import ReplayBuffer
from forge.actors.reward import RewardActor
from forge.actors.trainer import TitanTrainer
from forge.config import parse_args, save_config
from forge.controller import init_provisioner, shutdown
from forge.data.prompts import load_prompt_rows
from forge.data.rewards import get_reward_fn
from forge.engines.generation import check_model_dir
from forge.observability import Reduce, get_metric_logger, record_metric
from forge.rollout import greedy_accuracy, rollout_step
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


def check_inputs(cfg: GRPOConfig) -> None:
    """Fails before any process starts on what would otherwise fail deep inside an actor."""
    check_model_dir(cfg.policy_path, "policy_path")
    load_prompt_rows(cfg.dataset)  # raises on a missing column or an empty prompt set


def progress_line(step: int, row: dict, accuracy: float | None, step_s: float) -> str:
    parts = [f"step {step:4d}", f"reward {row.get('rollout/reward', float('nan')):.3f}"]
    if accuracy is not None:
        parts.append(f"eval acc {accuracy:.3f}")
    parts += [
        f"policy age {row.get('buffer/policy_age_mean', float('nan')):.2f}",
        f"gen {row.get('generator/tokens_per_s', float('nan')):.0f} tok/s",
        f"sync {row.get('grpo/weight_sync_ms', float('nan')):.0f} ms",
        f"wait {row.get('grpo/wait_batch_ms', float('nan')):.0f} ms",
        f"{step_s:.2f} s/step",
    ]
    return " | ".join(parts)


async def run(cfg: GRPOConfig) -> dict:
    torch.manual_seed(cfg.seed)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    if cfg.actor_threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(cfg.actor_threads)  # before any actor process starts
    await init_provisioner(cfg.provisioner, seed=cfg.seed)
    try:
        return await _train(cfg)
    finally:
        await shutdown()


async def _train(cfg: GRPOConfig) -> dict:
    metric_logger = await get_metric_logger(cfg.metrics)
    await store.initialize()

    from transformers import AutoTokenizer

    pad_id = AutoTokenizer.from_pretrained(cfg.policy_path).pad_token_id or 0
    transport = resolve_transport(cfg.generator.weight_transport)
    gpus = torch.cuda.is_available()  # model actors each get their own GPUs when there are any
    dataset, generator, trainer, replay_buffer, reward, advantages, reference = await asyncio.gather(
        DatasetActor.as_actor(cfg.dataset),
        Generator.options(with_gpus=gpus).as_actor(
            cfg.generator.model_copy(update={"weight_transport": transport})
        ),
        TitanTrainer.options(procs=cfg.trainer.procs, with_gpus=gpus, gpu_group="trainer").as_actor(
            cfg.trainer.engine,
            cfg.trainer.loss,
            weights_dtype=cfg.generator.dtype,
            keep_weight_versions=cfg.keep_weight_versions,
            weight_transport=transport,
        ),
        ReplayBuffer.as_actor(cfg.replay_buffer, pad_id, cfg.dp_size),
        RewardActor.as_actor(cfg.reward),
        ComputeAdvantages.as_actor(cfg.rollout.advantage),
        # On the trainer's GPU: a KL term needs no GPU of its own.
        ReferenceModel.options(with_gpus=gpus, gpu_group="trainer").as_actor(
            cfg.trainer.engine, cfg.generator.sampling.temperature
        )
        if cfg.use_reference
        else asyncio.sleep(0),
    )
    eval_rows = (await dataset.eval_set.call_one())[: cfg.eval.num_prompts]
    score_fn = get_reward_fn(cfg.eval.reward_fn)
    stop = asyncio.Event()
    bound = StalenessBound(cfg.replay_buffer.max_policy_age, cfg.replay_buffer.batch_size)
    rollout_episodes = cfg.rollout.prompts_per_step * cfg.rollout.group_size

    async def continuous_rollouts() -> None:
        """Waits for the staleness bound to allow a rollout, then makes one into the buffer."""
        while not stop.is_set():
            min_version = await bound.start_rollout(rollout_episodes)
            added: list[int] = []
            try:
                added = await rollout_step(
                    dataset=dataset,
                    generator=generator,
                    reward=reward,
                    advantages=advantages,
                    reference=reference,
                    replay_buffer=replay_buffer,
                    prompts_per_step=cfg.rollout.prompts_per_step,
                    group_size=cfg.rollout.group_size,
                    skip_groups_without_signal=cfg.rollout.skip_groups_without_signal,
                    min_version=min_version,
                )
            finally:
                await bound.finish_rollout(rollout_episodes, added)

    async def evaluate(version: int) -> float:
        return await greedy_accuracy(generator, eval_rows, score_fn, cfg.eval.max_tokens, version)

    async def continuous_training() -> dict:
        """Waits only for a batch; publishing the new weights overlaps the next step."""
        accuracy = await evaluate(0)
        history = {"eval_accuracy": [(0, accuracy)]}
        print(f"step    0 | eval acc {accuracy:.3f} (initial policy)", flush=True)
        version = 0
        for step in range(1, cfg.max_steps + 1):
            started = time.perf_counter()
            await bound.wait_for_batch()
            # The bound mirrors the buffer, so the first sample normally has a batch.
            while (batch := await replay_buffer.sample.call_one(version)) is None:
                await asyncio.sleep(0.05)
            record_metric("grpo/wait_batch_ms", (time.perf_counter() - started) * 1e3, Reduce.MEAN)
            await trainer.train_step.call(batch)
            version += 1
            sync_started = time.perf_counter()
            await trainer.push_weights.call(version)
            record_metric("grpo/weight_sync_ms", (time.perf_counter() - sync_started) * 1e3, Reduce.MEAN)
            episode_versions = [int(v) for b in batch for v in b.policy_versions]
            record_metric("grpo/trained_policy_age_max", version - 1 - min(episode_versions), Reduce.MAX)
            await bound.trained(episode_versions)
            accuracy = None
            if cfg.eval.every and (step % cfg.eval.every == 0 or step == cfg.max_steps):
                accuracy = await evaluate(version)
                record_metric("eval/accuracy", accuracy, Reduce.MEAN)
                history["eval_accuracy"].append((step, accuracy))
            record_metric("grpo/step_s", time.perf_counter() - started, Reduce.MEAN)
            row = await metric_logger.flush(step)
            print(progress_line(step, row, accuracy, time.perf_counter() - started), flush=True)
        await trainer.wait_published.call()
        return history

    rollouts = [asyncio.create_task(continuous_rollouts()) for _ in range(cfg.rollout.threads)]
    training = asyncio.create_task(continuous_training())
    try:
        done, _ = await asyncio.wait([training, *rollouts], return_when=asyncio.FIRST_COMPLETED)
        if training not in done:  # a rollout loop died: surface its error
            next(iter(done)).result()
        history = training.result()
    finally:
        # Also on Ctrl-C (asyncio cancels this coroutine): stop both loops before the actors.
        stop.set()
        for task in (training, *rollouts):
            task.cancel()
        await asyncio.gather(training, *rollouts, return_exceptions=True)
        await metric_logger.close()
        await store.shutdown()
    return history


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = parse_args(GRPOConfig, argv, description="GRPO training with forge")
    ensure_warm_start(cfg)
    try:
        check_inputs(cfg)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    started = time.perf_counter()
    try:
        history = asyncio.run(run(cfg))
    except KeyboardInterrupt:
        print("interrupted: actors stopped", file=sys.stderr)
        raise SystemExit(130) from None
    (first_step, first), (last_step, last) = history["eval_accuracy"][0], history["eval_accuracy"][-1]
    print(
        f"done in {time.perf_counter() - started:.0f} s: eval accuracy {first:.3f} (step {first_step}) "
        f"-> {last:.3f} (step {last_step})"
    )
    return history


if __name__ == "__main__":
    main()
