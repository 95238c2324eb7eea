"""GRPO's two loops over actor handles: continuous rollouts and continuous training, joined by
the replay buffer. forge.grpo.run launches the actors (forge.grpo.launch) and hands them here.

    rollout loops (x rollout.threads)            training loop
    ---------------------------------            -------------
    wait: staleness bound allows a rollout       wait: a batch is buffered
      (as many groups as the next steps lack)    ReplayBuffer.sample -> TitanTrainer.train_step
    rows -> trajectories (Generator turns,       TitanTrainer.push_weights(T+1): snapshot, then
      environment turns; newest weights, at        store put in the background -> generators
      least the version of the step that will      pick it up before their next request, or
      train them less max_policy_age)              while it runs (update_mode: in_flight)
      -> reward -> advantages -> reference     Critic.train_step on the same batch
      (teacher, critic) -> token advantages      (PPO: rollout.advantage gae)
      -> ReplayBuffer.add

The staleness bound (forge.staleness) pauses rollouts whose episodes could only go stale;
the training loop waits for nothing but a batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge.grpo.config import GRPOConfig
from forge.observability import Reduce, record_metric
from forge.observability.progress import Progress as ProgressDisplay
from forge.rewards.sources import RolloutScorer
from forge.rollout.eval import greedy_eval
from forge.rollout.records import RolloutRecorder, trim_run_records
from forge.rollout.step import RolloutCounts, Rollouts, rollout_step, wait_for_room
from forge.runs.checkpoint import Progress, RolloutPause, RunActors, RunCheckpointer
from forge.runs.faults import wait_for_loops
from forge.runs.guards import SkippedUpdates, starvation_report, wait_for_batch
from forge.runs.restarts import restarts_so_far
from forge.staleness import StalenessBound


@dataclass
class GRPOActors:
    """The handles the loops drive (trainer, advantages, reference, teacher and critic None when
    the config has none; with LoRA the reference is the trainer, `GRPOConfig.reference_in_trainer`),
    and the rollouts' scorer, on this process, over the reward actor and the reward models' services."""

    dataset: Any
    rollouts: Rollouts
    trainer: Any
    replay_buffer: Any
    scorer: RolloutScorer
    advantages: Any
    reference: Any
    teacher: Any = None
    critic: Any = None


def step_fields(row: dict, accuracy: float | None, step_s: float) -> dict[str, str]:
    """The key numbers of a step, as the progress bar or line shows them ("-": none this step,
    e.g. no rollout finished during it)."""

    def shown(key: str, spec: str, unit: str = "") -> str:
        return f"{row[key]:{spec}}{unit}" if key in row else "-"

    fields = {"reward": shown("rollout/reward", ".3f")}
    if accuracy is not None:
        fields["eval acc"] = f"{accuracy:.3f}"
        fields["eval reward"] = shown("eval/reward_mean", ".3f")
    fields["policy age"] = shown("buffer/policy_age_mean", ".2f")
    fields["gen"] = shown("generator/tokens_per_s", ".0f", " tok/s")
    fields["sync"] = shown("grpo/weight_sync_ms", ".0f", " ms")
    fields["wait"] = shown("grpo/wait_batch_ms", ".0f", " ms")
    fields["step"] = f"{step_s:.2f} s"
    return fields


class GRPOLoops:
    """The loops of one run; `run` returns the run's history."""

    def __init__(
        self,
        cfg: GRPOConfig,
        actors: GRPOActors,
        eval_rows: list[dict],
        eval_scorer: RolloutScorer,
        metric_logger,
        checkpoints: RunCheckpointer,
        recorder: RolloutRecorder | None,
    ):
        self.cfg, self.actors, self.eval_rows, self.eval_scorer = cfg, actors, eval_rows, eval_scorer
        self.metric_logger, self.checkpoints, self.recorder = metric_logger, checkpoints, recorder
        # Without a trainer the policy never changes, so no episode can grow stale.
        max_age = cfg.replay_buffer.max_policy_age if cfg.trainer.enabled else cfg.max_steps
        self.bound = StalenessBound(max_age, cfg.replay_buffer.batch_size)
        self.counts, self.skips = RolloutCounts(), SkippedUpdates(cfg.trainer.max_skipped_updates)
        self.pause, self.stop = RolloutPause(), asyncio.Event()
        self.saved = RunActors(
            actors.trainer,
            actors.replay_buffer,
            actors.dataset,
            actors.rollouts.generator,
            actors.rollouts.deadline.base_s,
            actors.critic,
        )

    async def resume(self) -> Progress:
        """The newest checkpoint's progress, with every actor's state restored from it."""
        a = self.actors
        progress = await self.checkpoints.resume(
            self.saved, a.trainer.push_weights.route, self.cfg.metrics.jsonl_path
        )
        self.bound.restore(progress.version, progress.buffered_versions)
        if self.recorder is not None:  # the steps after the checkpoint are recorded again
            trim_run_records(self.recorder.path, progress.last_kept_step)
        return progress

    async def run(self, progress: Progress) -> dict:
        rollout_loops = [asyncio.create_task(self._rollouts()) for _ in range(self.cfg.rollout.threads)]
        training = asyncio.create_task(self._training(progress))
        try:
            return await wait_for_loops(training, rollout_loops)
        finally:
            # Also on Ctrl-C (asyncio cancels this coroutine): stop both loops before the actors.
            self.stop.set()
            for task in (training, *rollout_loops):
                task.cancel()
            await asyncio.gather(training, *rollout_loops, return_exceptions=True)

    async def _rollouts(self) -> None:
        """Waits for the staleness bound to allow a rollout, then makes one into the buffer: up
        to `rollout.prompts_per_step` prompts, fewer when the next steps need fewer."""
        cfg, a = self.cfg, self.actors
        group_size = cfg.rollout.group_size
        while not self.stop.is_set():
            await wait_for_room(a.replay_buffer, self.counts, lambda: self.bound.version)
            waited_from = time.perf_counter()
            slot = await self.bound.start_rollout(cfg.rollout.samples, group_size)
            # Time the loop's generator replica may idle for the staleness bound (forge.staleness).
            record_metric("rollout/wait_for_slot_s", time.perf_counter() - waited_from, Reduce.SUM)
            added: list[int] = []
            try:
                async with self.pause.rollout():  # a checkpoint holds new rollouts (see RolloutPause)
                    added = await rollout_step(
                        dataset=a.dataset,
                        rollouts=a.rollouts,
                        scorer=a.scorer,
                        advantages=a.advantages,
                        reference=a.reference,
                        replay_buffer=a.replay_buffer,
                        prompts_per_step=slot.episodes // group_size,
                        group_size=group_size,
                        skip_groups_without_signal=cfg.rollout.skip_groups_without_signal,
                        min_version=slot.min_version,
                        counts=self.counts,
                        recorder=self.recorder,
                        teacher=a.teacher,
                        token_advantages=cfg.token_advantages,
                        critic=a.critic,
                    )
            finally:
                await self.bound.finish_rollout(slot, added)

    async def _next_batch(self, version: int):
        await self.bound.wait_for_batch()
        # The bound mirrors the buffer, so the first sample normally has a batch.
        while (batch := await self.actors.replay_buffer.sample.route(version)) is None:
            await asyncio.sleep(0.05)
        return batch

    async def _evaluate(self, version: int) -> float:
        """The eval's accuracy; its scores go to the step's metrics row."""
        scores = await greedy_eval(
            self.actors.rollouts,
            self.eval_rows,
            self.eval_scorer,
            self.cfg.eval.max_tokens,
            version,
            self.recorder,
        )
        record_metric("eval/accuracy", scores.accuracy, Reduce.MEAN)
        record_metric("eval/reward_mean", scores.reward_mean, Reduce.MEAN)
        return scores.accuracy

    async def _training(self, progress: Progress) -> dict:
        """Waits only for a batch; publishing the new weights overlaps the next step."""
        cfg, trainer, history = self.cfg, self.actors.trainer, progress.history

        async def explain_starvation() -> str:
            report = await starvation_report(
                self.counts,
                self.actors.replay_buffer,
                self.actors.scorer,
                cfg.replay_buffer,
                cfg.env,
                self.actors.rollouts.env_failures,
            )
            due = self.bound.due_line()
            return report if due is None else f"{report} {due}"

        display = ProgressDisplay(cfg.max_steps, desc="grpo", initial=progress.step)
        if progress.step == 0 and cfg.eval.every:
            accuracy = await self._evaluate(0)
            row = await self.metric_logger.flush(0)
            history["eval_accuracy"].append((0, accuracy))
            display.message(
                f"step 0 | eval acc {accuracy:.3f} | eval reward {row.get('eval/reward_mean', float('nan')):.3f} (initial policy)"
            )
        version = progress.version
        for step in range(progress.step + 1, cfg.max_steps + 1):
            started = time.perf_counter()
            if self.recorder is not None:
                self.recorder.step = step
            batch = await wait_for_batch(
                self._next_batch(version), cfg.replay_buffer.starve_timeout_s, explain_starvation
            )
            record_metric("grpo/wait_batch_ms", (time.perf_counter() - started) * 1e3, Reduce.MEAN)
            episode_versions = [int(v) for b in batch for v in b.policy_versions]
            if trainer is not None:  # trainer.enabled=false: only generate and record
                async with self._generator_asleep():
                    self.skips.observe(step, await self._train_step(batch))
                version += 1
                sync_started = time.perf_counter()
                await trainer.push_weights.route(version)
                record_metric("grpo/weight_sync_ms", (time.perf_counter() - sync_started) * 1e3, Reduce.MEAN)
                record_metric("grpo/trained_policy_age_max", version - 1 - min(episode_versions), Reduce.MAX)
            await self.bound.trained(episode_versions)
            accuracy = None
            if cfg.eval.every and (step % cfg.eval.every == 0 or step == cfg.max_steps):
                accuracy = await self._evaluate(version)
                history["eval_accuracy"].append((step, accuracy))
            record_metric("grpo/step_s", time.perf_counter() - started, Reduce.MEAN)
            record_metric("run/restarts", restarts_so_far(), Reduce.MAX)
            row = await self.metric_logger.flush(step)
            display.update(
                step, step_fields(row, accuracy, time.perf_counter() - started), persist=accuracy is not None
            )
            if trainer is not None:
                await self._save(step, version, history)
        display.close()
        if trainer is not None:
            await trainer.wait_published.route()
        return history

    async def _train_step(self, batch) -> dict[str, float]:
        """The policy's step on `batch`, and the critic's on the same batch at the same time
        (where there is one); returns the policy's metrics."""
        trainer, critic = self.actors.trainer, self.actors.critic
        if critic is None:
            return await trainer.train_step.route(batch)
        metrics, _ = await asyncio.gather(trainer.train_step.route(batch), critic.train_step.route(batch))
        return metrics

    @contextlib.asynccontextmanager
    async def _generator_asleep(self):
        """With `generator.vllm.sleep_during_train`, vLLM gives its GPU memory back for the train
        step (a serial pipeline: no rollout runs meanwhile, see GRPOConfig)."""
        if not self.cfg.generator.vllm.sleep_during_train:
            yield
            return
        generator = self.actors.rollouts.generator
        await generator.sleep.fanout(True)
        try:
            yield
        finally:
            await generator.sleep.fanout(False)

    async def _save(self, step: int, version: int, history: dict) -> None:
        """The step's checkpoint and export, when the config asks for them."""
        cfg = self.cfg
        last = step == cfg.max_steps
        if cfg.checkpoint.due(step, last):
            async with self.pause.paused():
                await self.checkpoints.save(Progress(step, version, history), self.saved)
                if self.recorder is not None:
                    # Rollouts that finish from now on are not in the checkpoint: a resume from
                    # it drops their records with those of step + 1.
                    self.recorder.step = step + 1
        if last or (cfg.checkpoint.export_every and step % cfg.checkpoint.export_every == 0):
            await self.actors.trainer.export_hf.route(
                str(Path(cfg.output_dir, "export").resolve()), cfg.policy_path, cfg.checkpoint.export_dtype
            )
            if cfg.trainer.engine.lora is not None:  # the adapter alone too, for PEFT and vLLM's LoRA
                await self.actors.trainer.export_peft.route(
                    str(Path(cfg.output_dir, "export_adapter").resolve())
                )
