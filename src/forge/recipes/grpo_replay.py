"""Train-only debugging: the GRPO trainer on the exact batches of a recorded run.

A GRPO run with `metrics.rollouts_path` set records every episode that enters the replay
buffer (rollouts.jsonl) and, next to it, the episode ids of each training batch in order
(rollouts.batches.jsonl, see `forge.rollout.records`). Replay rebuilds those
batches, token for token and logprob for logprob, and trains on them with no generator,
reward, reference or dataset actor. From the same initial policy and seed, step k of the
replay sees the batch step k of the recorded run saw, so on CPU its losses are the
recorded run's, bit for bit: a change to the trainer or the loss can be judged on fixed
data, and a training-side problem reproduced without generation.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from forge.actors.trainer import TitanTrainer
from forge.data.types import Completion, Episode
from forge.engines.titan.config import TitanEngineConfig
from forge.engines.titan.shares import share_of
from forge.observability import MetricsConfig, Reduce, get_metric_logger, record_metric
from forge.observability.progress import Progress
from forge.rl.batch import PolicyBatch
from forge.rl.losses import LossConfig
from forge.rollout.records import (
    batches_path,
    decode_floats,
    decode_ids,
    read_records,
    turns_from_record,
)


def episode_from_record(record: dict) -> Episode:
    completion = Completion(
        prompt=record["prompt"],
        prompt_ids=decode_ids(record["prompt_ids"]),
        response_ids=decode_ids(record["response_ids"]),
        logprobs=decode_floats(record["logprobs"]),
        text=record["completion"],
        stop_reason=record["stop_reason"],
        policy_version=record["policy_version"],
        response_mask=decode_ids(record["response_mask"]) if "response_mask" in record else None,
        turns=turns_from_record(record),
        truncated=record.get("truncated", False),
    )
    return Episode(
        completion,
        record["target"],
        record["group_id"],
        reward=record["reward"],
        reward_breakdown=record["reward_breakdown"],
        advantage=record["advantage"],
        ref_logprobs=decode_floats(record["ref_logprobs"]),
        episode_id=record["episode_id"],
        token_advantages=decode_floats(record.get("token_advantages")),
        values=decode_floats(record.get("values")),
        returns=decode_floats(record.get("returns")),
    )


def load_replay_batches(rollouts_path: str | Path) -> list[list[list[Episode]]]:
    """The recorded run's training batches, in order: per step, per data-parallel rank, episodes."""
    rollouts_path = Path(rollouts_path)
    recorded_batches = batches_path(rollouts_path)
    if not recorded_batches.is_file():
        raise FileNotFoundError(
            f"rollout.replay_from: {recorded_batches} (the replay buffer's record of each training "
            f"batch, written next to {rollouts_path.name}) is missing; record the run with "
            "metrics.rollouts_path set"
        )
    records = {r["episode_id"]: r for r in read_records(rollouts_path) if not r["eval"]}
    batches = []
    for step, line in enumerate(read_records(recorded_batches), start=1):
        missing = [i for rank in line["episode_ids"] for i in rank if i not in records]
        if missing:
            raise ValueError(
                f"rollout.replay_from: training batch {step} holds {len(missing)} episodes that "
                f"{rollouts_path} does not record (e.g. {missing[0]}); replay needs every episode: "
                "record the run with metrics.rollouts_every=1"
            )
        batches.append([[episode_from_record(records[i]) for i in rank] for rank in line["episode_ids"]])
    return batches


def regroup(per_rank: list[list[Episode]], ranks: int) -> list[list[Episode]]:
    """A recorded batch for `ranks` data-parallel ranks: as recorded when the counts agree, else
    the recorded ranks' episodes in rank order, split into `ranks` equal contiguous shares. A
    step trains on the same episodes either way, so the losses of a run recorded on N ranks can
    be compared with a replay on M (equal up to the order of floating-point sums)."""
    if len(per_rank) == ranks:
        return per_rank
    episodes = [episode for share in per_rank for episode in share]
    if len(episodes) % ranks:
        raise ValueError(
            f"rollout.replay_from: a recorded batch of {len(episodes)} episodes cannot be split over "
            f"{ranks} data-parallel ranks: replay with a trainer whose data-parallel size divides it"
        )
    return [share_of(episodes, rank, ranks) for rank in range(ranks)]


async def replay_training(
    rollouts_path: str | Path,
    *,
    trainer_engine: TitanEngineConfig,
    trainer_loss: LossConfig,
    trainer_procs: int,
    dp_size: int,
    pad_id: int,
    max_steps: int,
    metrics: MetricsConfig,
    run_config: dict | None = None,
) -> int:
    """Trains on up to `max_steps` recorded batches; returns the number of steps trained."""
    batches = [regroup(per_rank, dp_size) for per_rank in load_replay_batches(rollouts_path)[:max_steps]]
    metric_logger = await get_metric_logger(metrics, run_config)
    trainer = await TitanTrainer.options(procs=trainer_procs, with_gpus=torch.cuda.is_available()).as_actor(
        trainer_engine, trainer_loss
    )
    progress = Progress(len(batches), desc="grpo replay")
    try:
        for step, per_rank in enumerate(batches, start=1):
            started = time.perf_counter()
            await trainer.train_step.route(
                [PolicyBatch.from_episodes(episodes, pad_id) for episodes in per_rank]
            )
            for episode in (e for episodes in per_rank for e in episodes):
                record_metric("rollout/reward", episode.reward, Reduce.MEAN)
            record_metric("grpo/step_s", time.perf_counter() - started, Reduce.MEAN)
            row = await metric_logger.flush(step)
            progress.update(step, {"loss": f"{row.get('train/loss', float('nan')):.4f}"})
    finally:
        progress.close()
        await metric_logger.close()
    return len(batches)
