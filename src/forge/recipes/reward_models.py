"""Reward models in this process, for the serial recipe: the clients (`forge.rewards.sources.
ModelClient`) of a classifier and of a judge, with the engines the app's actors wrap."""

from __future__ import annotations

from forge.actors.generator import build_generation_engine
from forge.actors.reward import RewardConfig, RewardModelConfig
from forge.actors.reward_models import judge_generator_config, judge_renderer
from forge.engines.generation import to_completions
from forge.engines.reward_classifier import ClassifierRewardEngine
from forge.rewards.sources import ModelClient


class LocalClassifier:
    def __init__(self, m: RewardModelConfig):
        self.engine = ClassifierRewardEngine(m.path, m.batch_size, m.dtype)

    async def classify(self, prompts: list[str], responses: list[str]) -> list[float]:
        return self.engine.score(prompts, responses)


class LocalJudge:
    """Its questions are rendered as the app's judge client renders them (`judge_renderer`)."""

    def __init__(self, m: RewardModelConfig):
        cfg = judge_generator_config(m)
        self.sampling = cfg.sampling
        self.renderer = judge_renderer(m)
        tokenizer = self.renderer.tokenizer
        self.engine = build_generation_engine(cfg, tokenizer.eos_token_id, tokenizer)

    async def answer(self, questions: list[str]) -> list[str]:
        ids = [self.renderer.render(q).ids for q in questions]
        completions = to_completions(
            questions, ids, self.engine.generate(ids, self.sampling), self.renderer.tokenizer, 0
        )
        return [samples[0].text for samples in completions]


def local_reward_models(cfg: RewardConfig) -> list[ModelClient]:
    """A client of each model of `reward.models`, in order, loaded in this process."""
    return [LocalClassifier(m) if m.kind == "classifier" else LocalJudge(m) for m in cfg.models]
