"""Reward models as actors: a classifier actor, a judge (a frozen `Generator`), and their
services as the clients a `forge.rewards.sources.RewardModel` source scores with.

Each model of `reward.models` runs as a service, also with one replica: a replica that dies or
misses its call's deadline (`timeout_s`) is replaced and the call retried
(forge.controller.service), where a lone actor's death would stop the run and a hung one,
killed, would leave every later rollout unscored. A call that fails for good scores
`reward.error_reward` for its responses and is counted (`forge.rewards.sources`); the run goes
on, as it does for reward functions.

The services are handles of the controller (they replace replicas from its event loop): a
`Service` cannot be handed to another actor. So the rollout's scorer runs on the controller and
calls them from there (`forge.rewards.sources.RolloutScorer`), next to its call to the reward
actor that runs the reward functions.
"""

from __future__ import annotations

import asyncio
from typing import Any

from monarch.actor import endpoint

from forge.actors.generator import Generator, GeneratorConfig
from forge.actors.reward import RewardConfig, RewardModelConfig
from forge.controller import ForgeActor
from forge.controller.gpu_plan import TRAINER_GROUP
from forge.controller.liveness import ActorHungError
from forge.controller.service import ReplicaHungError
from forge.data.chat_prompts import PromptRenderer


class ClassifierRewardModel(ForgeActor):
    """Scores (prompt, response) pairs with a sequence-classification model
    (forge.engines.reward_classifier)."""

    def __init__(self, path: str, batch_size: int = 32, dtype: str = "float32"):
        self.path, self.batch_size, self.dtype = path, batch_size, dtype

    @endpoint
    async def setup(self) -> None:
        from forge.engines.reward_classifier import ClassifierRewardEngine

        self.engine = ClassifierRewardEngine(self.path, self.batch_size, self.dtype)

    @endpoint
    async def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        return self.engine.score(prompts, responses)


def judge_generator_config(m: RewardModelConfig) -> GeneratorConfig:
    """The judge's generator: its model, engine and sampling (n=1, greedy unless configured)."""
    return GeneratorConfig(
        model_path=m.path, engine=m.engine, dtype=m.dtype, vllm=m.vllm, sampling=m.sampling
    )


def judge_renderer(m: RewardModelConfig) -> PromptRenderer:
    """How a judge's questions become ids: rendered by the caller like every prompt, with the
    judge's own tokenizer and chat template (a question is one user message). The app's judge
    client and the serial recipe's both render with it, in the process that asks."""
    from transformers import AutoTokenizer

    return PromptRenderer(AutoTokenizer.from_pretrained(m.path), "auto", f"reward.models[{m.name}]")


async def launch_reward_model(m: RewardModelConfig, gpus: bool) -> Any:
    """A service of `m.replicas` copies of the model; with GPUs, each on its own or the trainer's."""
    placement = dict(
        num_replicas=m.replicas, with_gpus=gpus, gpu_group=TRAINER_GROUP if m.gpu == "trainer" else None
    )
    if m.kind == "classifier":
        return await ClassifierRewardModel.options(**placement).as_service(m.path, m.batch_size, m.dtype)
    return await Generator.options(**placement).as_service(judge_generator_config(m), follows_policy=False)


class ServiceModel:
    """A reward model's service (or lone actor) as a `forge.rewards.sources.ModelClient`: every
    call within the model's `timeout_s`; one whose last try hung raises `TimeoutError`. A judge's
    questions are rendered here (`judge_renderer`) and sent as ids."""

    def __init__(self, handle, timeout_s: float, renderer: PromptRenderer | None = None):
        self.handle, self.timeout_s, self.renderer = handle, timeout_s, renderer

    async def classify(self, prompts: list[str], responses: list[str]) -> list[float]:
        return await self._within(self.handle.score, prompts, responses)

    async def answer(self, questions: list[str]) -> list[str]:
        answers = await self._within(self.handle.generate, [self.renderer.render(q).ids for q in questions])
        return [completions[0].text for completions in answers]

    async def _within(self, endpoint, *args):
        try:
            return await endpoint.route_within(self.timeout_s, *args)
        except (ActorHungError, ReplicaHungError) as e:  # the last replica it tried hung
            raise TimeoutError(str(e)) from e


async def launch_reward_models(cfg: RewardConfig, gpus: bool) -> list[ServiceModel]:
    """A client of each model of `reward.models`, in order, over its service."""
    handles = await asyncio.gather(*(launch_reward_model(m, gpus) for m in cfg.models))
    return [
        ServiceModel(h, m.timeout_s, judge_renderer(m) if m.kind == "judge" else None)
        for m, h in zip(cfg.models, handles, strict=True)
    ]
