"""GRPO in one process, one thing at a time: the readable recipe, and the reference the actor
pipeline (apps/grpo) is tested against.

Each step, top to bottom:
  1. rollouts: draw prompts, roll out a group of trajectories per prompt with the current
     policy (one completion each without an environment; with one, model and environment
     take turns, forge.rollout.groups), score them, give each a group-relative advantage, and
     put the groups that carry a learning signal in the replay buffer, until it holds a batch
     (with REINFORCE++, a critic or a teacher, each token gets its own advantage once the
     reference, the teacher and the critic have scored the rollout's episodes,
     forge.rollout.token_advantages);
  2. one optimizer step of the policy on a batch drawn from the buffer (and of the critic, PPO's
     value model, on the same batch);
  3. the sampling engine takes the new weights.

It uses the run's configuration (forge.grpo.config.GRPOConfig) and the very pieces the actors
wrap (the engines, the reward scorer, the advantage function, the buffer's logic, the
seeded sampling), so with `replay_buffer.max_policy_age: 0` and one rollout loop the app
produces the same episodes, losses and rewards step for step (tests/grpo/test_grpo_durable.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import torch
from transformers import AutoTokenizer

from forge.actors.generator import build_generation_engine
from forge.data.chat_prompts import PromptRenderer
from forge.data.prompts import PromptCursor, load_prompt_rows
from forge.data.types import Completion, Episode
from forge.engines.generation import to_completions
from forge.engines.titan.engine import TitanEngine
from forge.engines.titan.logprobs import completion_logprobs
from forge.engines.titan.value import ValueEngine, completion_values, critic_metrics
from forge.envs.sessions import LocalEnvironments
from forge.envs.turns import TurnRenderer
from forge.grpo.config import GRPOConfig
from forge.observability import Reduce, record_metric
from forge.observability.collector import pop_state
from forge.recipes.reward_models import local_reward_models
from forge.replay_buffer import EpisodeBuffer
from forge.rewards.scorer import RewardScorer
from forge.rewards.sources import RewardFunctions, RolloutScorer
from forge.rl.advantage import group_advantages, has_signal
from forge.rl.batch import PolicyBatch
from forge.rl.losses import loss_from_config
from forge.rl.losses.value import ValueLoss
from forge.rollout.env_failures import EnvFailures
from forge.rollout.eval import score_answers
from forge.rollout.groups import OneTurn, run_groups
from forge.rollout.step import without_truncated


def grpo_serial(cfg: GRPOConfig, on_step: Callable[[int, dict[str, float]], None] | None = None) -> dict:
    """Trains for `cfg.max_steps` steps (with one data-parallel rank). Returns `{"metrics": one
    row per step, with the app's metric names and "step", "eval_accuracy": [(step, accuracy),
    ...] from step 0}`; `on_step(step, row)` sees each row as it is made. Runs torch on `cfg.actor_threads` threads, as each of the app's
    actors does."""
    if cfg.agent is not None:
        raise ValueError(
            f"agent ({cfg.agent.function}): the serial recipe runs environments only; run an agent with "
            "the app (python -m apps.grpo.main)"
        )
    if cfg.actor_threads is not None:
        torch.set_num_threads(cfg.actor_threads)
    torch.manual_seed(cfg.seed)
    pop_state()  # this run's metrics only
    tokenizer = AutoTokenizer.from_pretrained(cfg.generator.model_path)  # the sampler's, as the app
    pad_id = tokenizer.pad_token_id or 0

    # The policy is trained by TorchTitan and sampled by a separate engine, as in the app:
    # the two hold the same weights after every step.
    # The policy and the reference score the ids the sampler samples, those the tokenizer decodes
    # (a checkpoint may have more vocabulary rows), as the app's do.
    cfg.trainer.engine.model.sampled_rows = len(tokenizer)
    policy = TitanEngine(cfg.trainer.engine, trainable=True)
    sampler = build_generation_engine(cfg.generator, tokenizer.eos_token_id, tokenizer)
    # Rows become trajectories as in the app (forge.rollout.groups): the chat template renders the
    # prompts and the environment's turns; the environment runs here rather than in an actor.
    renderer = TurnRenderer(
        PromptRenderer(tokenizer, cfg.dataset.chat_template), cfg.generator.sampling.stop_token_ids
    )
    envs = (
        LocalEnvironments(cfg.env.name, cfg.env.params, step_timeout_s=cfg.env.step_timeout_s)
        if cfg.env is not None
        else OneTurn()
    )
    env_failures = EnvFailures()  # the run's: a kind of failure is logged in full once
    drop_truncated = cfg.env is not None and cfg.env.on_truncation == "drop"
    # The KL term's reference: the initial policy, or with LoRA the policy's own base model (its
    # adapters off), as the app's reference actor or trainer scores it.
    reference, reference_context = None, contextlib.nullcontext
    if cfg.reference_in_trainer:
        reference, reference_context = policy, policy.adapters_disabled
    elif cfg.use_reference:
        reference = TitanEngine(cfg.trainer.engine, trainable=False)
    # The teacher (distill) is a frozen model that scores the sampled tokens, as the reference does.
    teacher = TitanEngine(cfg.teacher_engine, trainable=False) if cfg.distill is not None else None
    # PPO's critic: a value model of its own, trained on the policy's batches.
    critic = ValueEngine(cfg.critic_engine) if cfg.critic is not None else None
    value_loss = ValueLoss(cfg.critic.value_clip) if cfg.critic is not None else None
    token_advantages = cfg.token_advantages
    loss_fn = loss_from_config(cfg.trainer.loss)
    # The functions in this process, with no time or memory limit: one process, one thing at a time
    # (the app's reward actor runs them in a worker process it can restart when one hangs); the
    # reward models each loaded here; scored by the app's kind of scorer.
    functions = RewardScorer([(f.name, f.weight) for f in cfg.reward.functions], remote=cfg.reward.remote)
    scorer = RolloutScorer.for_run(
        cfg.reward,
        RewardFunctions.in_process(functions),
        local_reward_models(cfg.reward),
        environment=cfg.env is not None,
    )
    train_rows, eval_rows = load_prompt_rows(cfg.dataset)
    prompts = PromptCursor(train_rows, cfg.dataset.seed)
    buffer = EpisodeBuffer(cfg.replay_buffer)
    eval_rows = eval_rows[: cfg.eval.num_prompts]
    eval_scorer = RolloutScorer(
        [RewardFunctions.in_process(RewardScorer([(cfg.eval.reward_fn, 1.0)]))],
        metric_prefix="eval/reward",
    )

    def generate(
        rows: list[dict],
        sample_keys: list[int] | None,
        version: int,
        group_size: int,
        max_tokens: int = cfg.generator.sampling.max_tokens,
        **sampling,
    ):
        async def sample(prompt_ids, keys, n: int, **overrides) -> list[list[Completion]]:
            params = cfg.generator.sampling.model_copy(update={"n": n, **overrides})
            outputs = sampler.generate(prompt_ids, params, keys)
            return to_completions([""] * len(prompt_ids), prompt_ids, outputs, tokenizer, version)

        return asyncio.run(
            run_groups(
                rows,
                sample_keys,
                group_size=group_size,
                generate=sample,
                renderer=renderer,
                max_tokens=max_tokens,
                envs=envs,
                limits=cfg.trajectory_limits,
                failures=env_failures,
                **sampling,
            )
        )

    def rollout(version: int) -> None:
        rows = [prompts.next() for _ in range(cfg.rollout.prompts_per_step)]
        groups = generate(rows, [r["index"] for r in rows], version, cfg.rollout.group_size)
        # A group whose environment failed is not scored (counted in rollout/env_failures).
        rows, groups = [r for r, g in zip(rows, groups, strict=True) if g], [g for g in groups if g]
        # All groups in one batch, as the reward actor scores them: group functions see each group.
        scored_groups = asyncio.run(scorer.score(groups, [r["target"] for r in rows]))
        episodes = []
        for row, group, scores in zip(rows, groups, scored_groups, strict=True):
            for total, *_ in scores:
                record_metric("rollout/reward", total, Reduce.MEAN)
            rewards = torch.tensor([total for total, *_ in scores], dtype=torch.float32)
            # A group whose rewards are all equal teaches nothing: skipped (DAPO's dynamic sampling).
            if cfg.rollout.skip_groups_without_signal and not has_signal(rewards):
                continue
            advantages = (
                [0.0] * len(scores)  # REINFORCE++ and GAE: each token's, below
                if cfg.rollout.advantage in ("reinforce_pp", "gae")
                else group_advantages(rewards, mode=cfg.rollout.advantage).tolist()
            )
            scored = [
                Episode(
                    c,
                    row["target"],
                    str(row["index"]),
                    reward=total,
                    reward_breakdown=parts,
                    reward_notes=notes,
                    advantage=a,
                )
                for c, (total, parts, notes), a in zip(group, scores, advantages, strict=True)
            ]
            episodes += [e for g in (without_truncated([scored]) if drop_truncated else [scored]) for e in g]
        temperature = cfg.generator.sampling.temperature
        if episodes and reference is not None:
            with reference_context():
                rows = completion_logprobs(reference, [e.completion for e in episodes], temperature)
            for episode, row in zip(episodes, rows, strict=True):
                episode.ref_logprobs = row
        if episodes and token_advantages is not None:
            teacher_rows = (
                completion_logprobs(teacher, [e.completion for e in episodes], temperature)
                if teacher is not None
                else None
            )
            value_rows = completion_values(critic, [e.completion for e in episodes]) if critic else None
            token_advantages.apply(episodes, teacher_rows, value_rows)
        for episode in episodes:
            buffer.add(episode)

    def accuracy() -> float:
        groups = generate(eval_rows, None, version, 1, max_tokens=cfg.eval.max_tokens, temperature=0.0)
        scores, _ = asyncio.run(score_answers(eval_rows, groups, eval_scorer))
        record_metric("eval/accuracy", scores.accuracy, Reduce.MEAN)
        record_metric("eval/reward_mean", scores.reward_mean, Reduce.MEAN)
        return scores.accuracy

    version, rows = 0, []
    history = {"metrics": rows, "eval_accuracy": [(0, accuracy())] if cfg.eval.every else []}
    pop_state()  # the initial eval's metrics are not step 1's
    for step in range(1, cfg.max_steps + 1):
        started = time.perf_counter()
        # 1. Rollouts by the current policy until the buffer holds a batch (it evicts
        #    episodes older than max_policy_age as it goes).
        buffer.evict(version)
        while len(buffer) < cfg.replay_buffer.batch_size:
            rollout(version)
        # 2. One optimizer step on a batch.
        [episodes] = buffer.sample(version)
        batch = PolicyBatch.from_episodes(episodes, pad_id)
        for key, value in policy.train_step(batch, loss_fn).items():
            record_metric(key, value, Reduce.MEAN)
        if critic is not None:
            for key, value in critic_metrics(critic.train_step(batch, value_loss)).items():
                record_metric(key, value, Reduce.MEAN)
        version += 1
        # 3. The sampler takes the new weights.
        sync_started = time.perf_counter()
        sampler.load_hf_state_dict(policy.hf_state_dict(getattr(torch, cfg.generator.dtype)))
        record_metric("grpo/weight_sync_ms", (time.perf_counter() - sync_started) * 1e3, Reduce.MEAN)
        if cfg.eval.every and (step % cfg.eval.every == 0 or step == cfg.max_steps):
            history["eval_accuracy"].append((step, accuracy()))
        record_metric("grpo/step_s", time.perf_counter() - started, Reduce.MEAN)
        row = {"step": step, **{key: acc.value() for key, acc in sorted(pop_state().items())}}
        rows.append(row)
        if on_step is not None:
            on_step(step, row)
    return history
