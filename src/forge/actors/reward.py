"""RewardActor: scores completions with the reward functions listed in config, and the reward
server of `reward.remote`."""

from __future__ import annotations

from typing import Literal

from monarch.actor import endpoint
from pydantic import Field, field_validator, model_validator

from forge.config import ForgeConfigModel
from forge.controller import ForgeActor
from forge.engines.generation import SamplingParams
from forge.engines.vllm_config import VLLMConfig
from forge.rewards.failures import Failure
from forge.rewards.functions import RewardFnName
from forge.rewards.judge import DEFAULT_TEMPLATE, JudgeParse, check_template
from forge.rewards.remote import REMOTE, RemoteRewardConfig
from forge.rewards.scorer import RewardScorer


class RewardFnConfig(ForgeConfigModel):
    # A built-in name (forge.rewards.functions.REWARD_FUNCTIONS) or "package.module:function"; a
    # function decorated with forge.rewards.group_functions.group_reward scores a group per call.
    name: RewardFnName
    weight: float = 1.0


# What a judge samples unless its `sampling` says otherwise: one greedy answer.
JUDGE_SAMPLING = SamplingParams(n=1, temperature=0.0, max_tokens=256)
_JUDGE_KEYS = ("template", "parse", "sampling", "engine", "vllm")


class RewardModelConfig(ForgeConfigModel):
    """A model that scores responses (forge.actors.reward_models), run as a service of
    `replicas` copies; a failed or hung call is retried on another (or a replacement) replica,
    and a call that fails for good scores reward.error_reward, counted in
    reward/<name>/errors or reward/<name>/timeouts."""

    # The key of its value in reward_breakdown and of its metrics (reward/<name>).
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    # A local Hugging Face directory: a *ForSequenceClassification model (classifier) or a causal
    # LM (judge), with its tokenizer.
    path: str
    # classifier: the model's score of (prompt, response) (forge.engines.reward_classifier);
    # judge: a generative model asked `template`, its answer read by `parse` (forge.rewards.judge).
    kind: Literal["classifier", "judge"]
    weight: float = 1.0
    # Responses per call (a rollout's responses go out in calls of this many, together, spread
    # over the replicas); a classifier scores each call in one forward pass.
    batch_size: int = Field(32, ge=1)
    replicas: int = Field(1, ge=1)
    # With GPUs: a GPU of its own, or a share of the trainer's (like the reference model).
    gpu: Literal["own", "trainer"] = "own"
    dtype: Literal["float32", "bfloat16"] = "float32"
    # Longest a call may take; a replica that misses it is killed and replaced.
    timeout_s: float = Field(300.0, gt=0)
    # Judge only: the question (fields {prompt}, {response}, {target}), how its answer becomes a
    # score, how it samples (n must be 1), and its engine (as generator.engine and generator.vllm).
    template: str = DEFAULT_TEMPLATE
    parse: JudgeParse = JudgeParse()
    sampling: SamplingParams = JUDGE_SAMPLING
    engine: Literal["auto", "vllm", "hf"] = "auto"
    vllm: VLLMConfig = VLLMConfig()

    @field_validator("template")
    @classmethod
    def _known_fields(cls, template: str) -> str:
        return check_template(template)

    @field_validator("sampling")
    @classmethod
    def _one_answer(cls, sampling: SamplingParams) -> SamplingParams:
        if sampling.n != 1:
            raise ValueError(f"sampling.n is {sampling.n}; a judge answers once: n: 1")
        return sampling

    @model_validator(mode="after")
    def _kind_settings(self) -> RewardModelConfig:
        judge_only = [k for k in _JUDGE_KEYS if k in self.model_fields_set]
        if self.kind == "classifier" and judge_only:
            raise ValueError(
                f"reward model '{self.name}': {judge_only} are settings of a judge, and its kind is "
                "classifier: remove them, or set kind: judge"
            )
        return self


class RewardConfig(ForgeConfigModel):
    functions: list[RewardFnConfig] = [RewardFnConfig(name="toy_task")]
    # What a response scores from a reward function that raises, returns anything but a finite
    # number, ends its process or times out (a group function: every response of the group),
    # and from the reward server when its batch failed for good (the run goes on; each failure
    # is counted in reward/<name>/errors or reward/<name>/timeouts).
    error_reward: float = 0.0
    # Longest a reward function may take on one response (a group function: on its group); the
    # functions then run in processes that are killed when a call hangs
    # (forge.rewards.scorer). None: in-process, no limit.
    timeout_s: float | None = Field(5.0, gt=0)
    # Most memory a reward function's call may map, in GiB, beyond what its process holds once the
    # functions are imported (RLIMIT_AS of the processes that run the calls; see
    # forge.rewards.worker). A call past it scores error_reward, counted in reward/<name>/errors,
    # and the calls after it run as usual. Applies with timeout_s set. None: no limit.
    memory_limit_gib: float | None = Field(4.0, gt=0)
    # A reward server that scores batches of responses over HTTP (forge.rewards.remote),
    # weighed in with the functions as reward/remote.
    remote: RemoteRewardConfig | None = None
    # Models that score responses too (classifiers and generative judges), each weighed in as
    # reward/<name>.
    models: list[RewardModelConfig] = []

    @model_validator(mode="after")
    def _memory_limit_needs_worker(self) -> RewardConfig:
        if (
            self.timeout_s is None
            and self.memory_limit_gib is not None
            and "memory_limit_gib" in self.model_fields_set
        ):
            raise ValueError(
                f"reward.memory_limit_gib is {self.memory_limit_gib:g} and reward.timeout_s is null: the limit "
                "applies to the worker processes that run the functions with a timeout_s; set a "
                "timeout_s, or memory_limit_gib: null"
            )
        return self

    @model_validator(mode="after")
    def _unique_names(self) -> RewardConfig:
        taken = {f.name: "a reward function" for f in self.functions}
        taken |= {REMOTE: "the reward server", "env": "the environment's reward", "total": "the total"}
        for model in self.models:
            if model.name in taken:
                raise ValueError(
                    f"reward.models: the name '{model.name}' is taken by {taken[model.name]}: give each "
                    "model a name of its own (it keys reward_breakdown and the reward/<name> metrics)"
                )
            taken[model.name] = "another reward model"
        return self


class RewardActor(ForgeActor):
    def __init__(self, cfg: RewardConfig):
        self.scorer = RewardScorer(
            [(f.name, f.weight) for f in cfg.functions], cfg.timeout_s, cfg.memory_limit_gib, cfg.remote
        )

    @endpoint
    async def evaluate_groups(
        self, prompts: list[list[str]], responses: list[list[str]], targets: list[str]
    ) -> list[list[dict[str, float | Failure]]]:
        """{function name: its value, or the `Failure` of the call that scored it} of every
        response of several groups, in one call, with group functions scoring each group as a
        whole (one prompt per response: after several turns each response has its own
        conversation before it). The rollout's scorer applies the failures."""
        return self.scorer.score_groups(prompts, responses, targets)

    async def __cleanup__(self, exc: Exception | None) -> None:
        """When the actor stops: the reward worker stops now, not when its pipe closes."""
        self.scorer.close()
        await super().__cleanup__(exc)
