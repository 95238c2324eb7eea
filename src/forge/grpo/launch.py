"""The actors of a GRPO run, one launch per config section, started together.

Each launch returns the section's handle (None where the config has no such actor); the model
actors get their own GPUs where the machine has any (`forge.controller.gpu_plan`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from forge.actors.advantages import ComputeAdvantages
from forge.actors.critic import Critic
from forge.actors.dataset import DatasetActor
from forge.actors.environment import ActorEnvironments, EnvironmentActor
from forge.actors.generator import Generator
from forge.actors.reference import ReferenceModel
from forge.actors.replay_buffer import ReplayBuffer
from forge.actors.reward import RewardActor
from forge.actors.reward_models import launch_reward_models
from forge.actors.trainer import TitanTrainer
from forge.agents.config import load_agent_function
from forge.agents.rollout import AgentRollouts
from forge.agents.server import AgentEndpoint
from forge.controller.gpu_plan import GENERATOR_GROUP, TRAINER_GROUP
from forge.data.chat_prompts import PromptRenderer
from forge.envs.turns import TurnRenderer
from forge.grpo.config import GRPOConfig
from forge.rewards.scorer import RewardScorer
from forge.rewards.sources import RewardFunctions, RolloutScorer
from forge.rollout.groups import OneTurn
from forge.rollout.records import RolloutRecorder, batches_path
from forge.rollout.step import Rollouts
from forge.runs.grpo_loops import GRPOActors
from forge.weight_transports import resolve_transport


def pad_id(tokenizer) -> int:
    """What pads the generator's ids in training batches."""
    return tokenizer.pad_token_id or 0


def turn_renderer(cfg: GRPOConfig, tokenizer) -> TurnRenderer:
    """The chat template of the generator's tokenizer, for opening prompts and environment turns."""
    return TurnRenderer(
        PromptRenderer(tokenizer, cfg.dataset.chat_template), cfg.generator.sampling.stop_token_ids
    )


async def launch_generator(cfg: GRPOConfig, gpus: bool, transport: str) -> Any:
    generators = Generator.options(
        with_gpus=gpus, num_replicas=cfg.generator.replicas, gpu_group=GENERATOR_GROUP
    )
    generator_cfg = cfg.generator.model_copy(update={"weight_transport": transport})
    if cfg.generator.replicas > 1:
        return await generators.as_service(generator_cfg, probe=cfg.generator.probe, lora=cfg.adapter_sync)
    return await generators.as_actor(generator_cfg, lora=cfg.adapter_sync)


async def launch_environments(cfg: GRPOConfig) -> ActorEnvironments | OneTurn:
    if cfg.env is None:  # single turn: the built-in environment, in this process
        return OneTurn()
    # A service even with one replica: an environment that crashes or blocks its process is
    # replaced, where a lone actor's death or hang would stop the run.
    service = await EnvironmentActor.options(num_replicas=cfg.env.replicas).as_service(
        cfg.env.name, cfg.env.params, cfg.env.step_timeout_s
    )
    return ActorEnvironments(service, cfg.env.step_timeout_s)


async def launch_trainer(cfg: GRPOConfig, gpus: bool, transport: str) -> Any | None:
    if not cfg.trainer.enabled:
        return None
    trainers = TitanTrainer.options(
        procs=cfg.trainer.procs, hosts=cfg.trainer.hosts, with_gpus=gpus, gpu_group=TRAINER_GROUP
    )
    return await trainers.as_actor(
        cfg.trainer.engine,
        cfg.trainer.loss,
        weights_dtype=cfg.generator.dtype,
        keep_weight_versions=cfg.keep_weight_versions,
        weight_transport=transport,
        verify_weights=cfg.generator.verify_weights,
        profile_step=cfg.trainer.profile_step,
        profile_dir=f"{cfg.output_dir}/profile",
    )


async def launch_reference(cfg: GRPOConfig, gpus: bool) -> Any | None:
    """With the trainer's processes, hosts, GPUs and parallelism: a KL term needs no GPU of its
    own, and each GPU holds a shard of the reference as it does of the policy. None where the
    trainer is the reference (LoRA: `GRPOConfig.reference_in_trainer`) or there is none."""
    if not cfg.reference_actor:
        return None
    references = ReferenceModel.options(
        procs=cfg.trainer.procs, hosts=cfg.trainer.hosts, with_gpus=gpus, gpu_group=TRAINER_GROUP
    )
    return await references.as_actor(cfg.trainer.engine, cfg.generator.sampling.temperature)


async def launch_teacher(cfg: GRPOConfig, gpus: bool) -> Any | None:
    """The teacher (distill) is a reference model of another checkpoint, placed as the reference
    is (with the trainer's processes, hosts, GPUs and parallelism), or with `distill.gpu: own` on
    processes and GPUs of its own. It scores at the sampling temperature, the distribution the
    policy's logprobs describe."""
    if cfg.distill is None:
        return None
    if cfg.distill.gpu == "own":
        teachers = ReferenceModel.options(procs=cfg.distill.procs, with_gpus=gpus)
    else:
        teachers = ReferenceModel.options(
            procs=cfg.trainer.procs, hosts=cfg.trainer.hosts, with_gpus=gpus, gpu_group=TRAINER_GROUP
        )
    return await teachers.as_actor(cfg.teacher_engine, cfg.generator.sampling.temperature, "teacher")


async def launch_critic(cfg: GRPOConfig, gpus: bool) -> Any | None:
    """PPO's value model, placed as the reference is: with the trainer's processes, hosts, GPUs
    and parallelism, so that it trains on the trainer's data-parallel batches as they are."""
    if cfg.critic is None:
        return None
    critics = Critic.options(
        procs=cfg.trainer.procs, hosts=cfg.trainer.hosts, with_gpus=gpus, gpu_group=TRAINER_GROUP
    )
    return await critics.as_actor(cfg.critic_engine, cfg.critic.value_clip)


async def launch_advantages(cfg: GRPOConfig) -> Any | None:
    """Group advantages; None where each episode's advantages are its tokens' alone (REINFORCE++,
    GAE)."""
    if cfg.rollout.advantage in ("reinforce_pp", "gae"):
        return None
    return await ComputeAdvantages.as_actor(cfg.rollout.advantage)


async def launch_replay_buffer(cfg: GRPOConfig, pad: int, recorder: RolloutRecorder | None) -> Any:
    # The buffer records each batch it hands out beside the rollout records.
    batches = str(batches_path(recorder.path)) if recorder else None
    return await ReplayBuffer.as_actor(cfg.replay_buffer, pad, cfg.dp_size, batches)


async def start_agent(cfg: GRPOConfig, renderer: TurnRenderer) -> AgentRollouts | None:
    """The agent's endpoint, serving on this host (stopped by the run's end)."""
    if cfg.agent is None:
        return None
    endpoint = AgentEndpoint(renderer, cfg.trainer.engine.training.seq_len, cfg.agent.max_calls)
    await endpoint.start()
    return AgentRollouts(
        load_agent_function(cfg.agent.function),
        endpoint,
        cfg.agent.timeout_s,
        cfg.generator.sampling.temperature,
    )


async def launch_actors(
    cfg: GRPOConfig, recorder: RolloutRecorder | None, eval_functions: RewardScorer, tokenizer
) -> GRPOActors:
    """Every actor of the run, launched together, and the rollouts' scorer over them; the eval's
    reward worker (`eval_functions`) starts meanwhile (not on the initial eval's time).
    `tokenizer`: the generator's."""
    pad = pad_id(tokenizer)
    transport = resolve_transport(cfg.generator.weight_transport, one_host=not cfg.provisioner.hosts)
    gpus = torch.cuda.is_available()
    (
        dataset,
        generator,
        envs,
        trainer,
        replay_buffer,
        reward,
        advantages,
        reference,
        teacher,
        critic,
        reward_models,
        _,
    ) = await asyncio.gather(
        DatasetActor.as_actor(cfg.dataset),
        launch_generator(cfg, gpus, transport),
        launch_environments(cfg),
        launch_trainer(cfg, gpus, transport),
        launch_replay_buffer(cfg, pad, recorder),
        RewardActor.as_actor(cfg.reward),
        launch_advantages(cfg),
        launch_reference(cfg, gpus),
        launch_teacher(cfg, gpus),
        launch_critic(cfg, gpus),
        launch_reward_models(cfg.reward, gpus),
        asyncio.to_thread(eval_functions.start),
    )
    if cfg.reference_in_trainer:
        reference = trainer
    renderer = turn_renderer(cfg, tokenizer)
    rollouts = Rollouts(
        generator,
        renderer,
        cfg.generator.sampling.max_tokens,
        envs,
        cfg.trajectory_limits,
        drop_truncated=cfg.env is not None and cfg.env.on_truncation == "drop",
        deadline=cfg.generator.deadline,
        agent=await start_agent(cfg, renderer),
    )
    # On this process: the reward models' services are its handles (forge.rewards.sources).
    scorer = RolloutScorer.for_run(
        cfg.reward,
        RewardFunctions.of(cfg.reward, reward.evaluate_groups.route),
        reward_models,
        environment=cfg.env is not None,
        agent=cfg.agent is not None,
    )
    return GRPOActors(
        dataset, rollouts, trainer, replay_buffer, scorer, advantages, reference, teacher, critic
    )
