"""The GRPO run's configuration: one section per actor, validated at start-up."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, model_validator

from forge.actors.generator import GeneratorConfig, resolve_engine
from forge.actors.reward import RewardConfig
from forge.agents.config import AgentConfig
from forge.config import ForgeConfigModel
from forge.controller import ProvisionerConfig
from forge.data.prompts import PromptDataConfig
from forge.engines.lora_sync import AdapterSync
from forge.engines.titan.config import ModelConfig, OptimizerConfig, ParallelismConfig, TitanEngineConfig
from forge.envs.config import EnvConfig
from forge.observability import MetricsConfig
from forge.replay_buffer import ReplayBufferConfig
from forge.rewards.functions import RewardFnName
from forge.rl.losses import GRPOLossConfig, LossConfig
from forge.runs.checkpoint import CheckpointConfig


class GRPOCheckpointConfig(CheckpointConfig):
    # The final policy is always exported to output_dir/export (with trainer.engine.lora: the
    # merged model there, and the PEFT adapter in output_dir/export_adapter); this also exports
    # every N steps.
    export_every: int = Field(0, ge=0, description="also export every N steps (0: only at the end)")
    # The exported weights' dtype; None keeps the starting checkpoint's (its config.json's).
    export_dtype: Literal["float32", "bfloat16", "float16"] | None = None


class TrainerSection(ForgeConfigModel):
    # false: no trainer process; the run only generates, scores and records rollouts for
    # max_steps batches (rollout-only debugging).
    enabled: bool = True
    procs: int = Field(1, ge=1, description="trainer processes on each host")
    # Hosts the trainer spans, `procs` ranks on each (needs provisioner.hosts; which hosts:
    # provisioner.placement.TitanTrainer).
    hosts: int = Field(1, ge=1)
    engine: TitanEngineConfig
    loss: LossConfig = GRPOLossConfig()
    # Updates with a non-finite loss or gradient norm are skipped; this many in a row stop the run.
    max_skipped_updates: int = Field(5, ge=1)
    # Profile the trainer's processes (the PyTorch profiler) from the start of this step to the
    # start of the next: a table and a trace per rank in output_dir/profile. Writing the trace
    # takes seconds, which the next step's time includes.
    profile_step: int | None = Field(None, ge=1)


class RolloutConfig(ForgeConfigModel):
    threads: int = Field(2, ge=1, description="concurrent copies of the rollout loop")
    prompts_per_step: int = Field(4, ge=1, description="prompts generated together in one batch")
    # 1 needs an advantage that is not a group's (reinforce_pp, gae).
    group_size: int = Field(8, ge=1, description="completions per prompt (the GRPO group)")
    # Groups whose rewards are all equal are not trained on (DAPO's dynamic sampling). With a
    # teacher (distill) or a critic (gae) every group has a signal, and a group of one has no
    # spread: unset, it is then false.
    skip_groups_without_signal: bool = True
    # grpo, dr_grpo, rloo, none: one advantage per episode from its group's rewards
    # (forge.rl.advantage.group_advantages); reinforce_pp: REINFORCE++'s per-token returns,
    # normalised over the episodes of each rollout (forge.rl.advantage.reinforce_pp_advantages);
    # gae: PPO's, GAE over the critic's values (needs a `critic` section), normalised likewise.
    advantage: Literal["grpo", "dr_grpo", "rloo", "none", "reinforce_pp", "gae"] = "grpo"
    # The per-token KL penalty in the reward (REINFORCE++'s, and PPO's with gae), kl_coef *
    # (generator logprob - reference logprob) on each sampled token; > 0 turns the reference
    # model on (reference.enabled: auto).
    kl_coef: float = Field(0.0, ge=0)
    # Train on the batches of a recorded run (its rollouts.jsonl) with no generator, reward or
    # reference actor (train-only debugging); see forge.recipes.grpo_replay.
    replay_from: str | None = None

    @property
    def samples(self) -> int:
        """The samples one rollout makes (one generate call, on one generator replica)."""
        return self.prompts_per_step * self.group_size


class ReferenceSection(ForgeConfigModel):
    # auto: run the reference model only when the loss has a KL term (loss.beta > 0).
    enabled: Literal["auto", "on", "off"] = "auto"


class DistillConfig(ForgeConfigModel):
    """On-policy distillation: a frozen teacher scores every token the policy samples, and each
    sampled token's advantage adds ``weight * (teacher logprob - policy logprob)``, the per-token
    reverse KL to the teacher (forge.rl.advantage.distill_advantages), to the rewards'."""

    # A Hugging Face checkpoint directory forge can load, usually larger than the policy, whose
    # tokenizer is the policy's (checked before the run).
    teacher_path: str
    # The distillation term's weight against the rewards' advantages (no reward function: the
    # teacher's signal alone).
    weight: float = Field(1.0, gt=0)
    # Where the teacher runs: `trainer`, beside the trainer on its processes and GPUs, with its
    # parallelism (each GPU holds a shard of the teacher too); `own`, on `procs` processes of its
    # own, a GPU each after the generators' (provisioner.colocate=false), its weights sharded over
    # them (FSDP), for a teacher that does not fit beside the trainer.
    gpu: Literal["trainer", "own"] = "trainer"
    procs: int = Field(1, ge=1, description="the teacher's processes with gpu: own")

    @model_validator(mode="after")
    def _procs_need_own(self) -> DistillConfig:
        if self.procs != 1 and self.gpu != "own":
            raise ValueError(
                f"distill.procs ({self.procs}) applies to a teacher on GPUs of its own: set distill.gpu: own, "
                "or leave procs out (beside the trainer it has the trainer's processes)"
            )
        return self


class CriticConfig(ForgeConfigModel):
    """PPO's critic (rollout.advantage: gae): a value model, the policy's architecture with a
    scalar head, trained every step on the trained batch's returns with value clipping
    (forge.engines.titan.value). It runs beside the trainer, on its processes and GPUs."""

    # A Hugging Face checkpoint of the policy's architecture whose transformer starts the
    # value model (its LM head is dropped, the value head starts at 0); None: the policy's.
    path: str | None = None
    # The critic's optimizer; each key left unset takes trainer.engine.optimizer's.
    optimizer: OptimizerConfig = OptimizerConfig()
    # PPO's value clipping: a value may move at most this far from the one the episode was
    # scored with before the loss stops rewarding it; null: no clipping.
    value_clip: float | None = Field(0.2, gt=0)
    gamma: float = Field(1.0, ge=0, le=1, description="GAE's discount over the response tokens")
    lam: float = Field(0.95, ge=0, le=1, description="GAE's lambda (1: Monte Carlo returns)")


class EvalConfig(ForgeConfigModel):
    every: int = Field(
        10, ge=0, description="evaluate every N steps, before step 1 and at the end (0: never evaluate)"
    )
    num_prompts: int = Field(200, ge=1)
    max_tokens: int = Field(8, ge=1)
    reward_fn: RewardFnName = "exact_match"


class WarmStartConfig(ForgeConfigModel):
    # When the policy directory is missing, produce it first with this SFT config.
    sft_config: str | None = None
    sft_overrides: list[str] = []


class GRPOConfig(ForgeConfigModel):
    seed: int = Field(0, ge=0)
    max_steps: int = Field(100, ge=1)
    output_dir: str = "outputs/grpo"
    # Continue from the newest checkpoint in output_dir/checkpoints (see `checkpoint`): true
    # needs one there; auto continues from it if there is one, else starts.
    resume: bool | Literal["auto"] = False
    # When an actor that nothing replaces dies or hangs, restart the whole pipeline from the
    # newest checkpoint, up to this many times in one invocation (forge.runs.restarts), waiting
    # restart_backoff_s before the first restart and twice as long before each next one.
    max_restarts: int = Field(0, ge=0)
    restart_backoff_s: float = Field(5.0, ge=0)
    checkpoint: GRPOCheckpointConfig = GRPOCheckpointConfig()
    policy_path: str
    warm_start: WarmStartConfig = WarmStartConfig()
    dataset: PromptDataConfig = PromptDataConfig()
    # Multi-turn episodes with an environment (forge.envs); None: one turn per prompt.
    env: EnvConfig | None = None
    # An agent program that talks to the policy over the OpenAI API (forge.agents), instead of
    # an environment.
    agent: AgentConfig | None = None
    generator: GeneratorConfig = GeneratorConfig()
    trainer: TrainerSection
    reference: ReferenceSection = ReferenceSection()
    # A teacher to distill on-policy (None: none).
    distill: DistillConfig | None = None
    # PPO's critic (None: none); rollout.advantage=gae needs it.
    critic: CriticConfig | None = None
    reward: RewardConfig = RewardConfig()
    rollout: RolloutConfig = RolloutConfig()
    replay_buffer: ReplayBufferConfig = ReplayBufferConfig()
    eval: EvalConfig = EvalConfig()
    metrics: MetricsConfig = MetricsConfig()
    provisioner: ProvisionerConfig = ProvisionerConfig()
    # Torch CPU threads in each actor process (inherited through OMP_NUM_THREADS). On a
    # small CPU machine one each keeps the generator and the trainer from oversubscribing it.
    actor_threads: int | None = Field(None, ge=1, description="None leaves torch's default")
    # Keep this many newest weight versions in the store (older ones are deleted).
    keep_weight_versions: int = Field(2, ge=1)

    @model_validator(mode="after")
    def _checked_then_resolved(self) -> GRPOConfig:
        self._check()
        self._resolve()
        return self

    def _check(self) -> None:
        """Refuses settings that disagree with each other; changes nothing."""
        profiled = self.trainer.profile_step
        if profiled is not None and profiled >= self.max_steps:
            raise ValueError(
                f"trainer.profile_step ({profiled}) must be below max_steps ({self.max_steps}): the "
                "profile covers a step up to the start of the next"
            )
        if self.env is not None and self.agent is not None:
            raise ValueError(
                f"env ({self.env.name}) and agent ({self.agent.function}) are two sources of episodes: set one"
            )
        if self.rollout.replay_from is not None and not self.trainer.enabled:
            raise ValueError("rollout.replay_from trains on recorded rollouts: it needs trainer.enabled=true")
        loss_temperature = getattr(self.trainer.loss, "temperature", None)
        if (
            "temperature" in self.trainer.loss.model_fields_set
            and loss_temperature != self.generator.sampling.temperature
        ):
            raise ValueError(
                f"trainer.loss.temperature ({loss_temperature}) must equal "
                f"generator.sampling.temperature ({self.generator.sampling.temperature}): the loss "
                "recomputes the generator's logprobs and they must describe the same distribution"
            )
        sampling = self.generator.sampling
        if sampling.top_p < 1 or sampling.top_k > 0:
            raise ValueError(
                f"generator.sampling.top_p ({sampling.top_p}) < 1 or top_k ({sampling.top_k}) > 0 filters "
                "the sampling distribution, but the trainer recomputes unfiltered logprobs, which biases the "
                "importance ratio below 1: train with top_p 1.0 and top_k 0"
            )
        if self.trainer.hosts > len(self.provisioner.hosts or [None]):
            raise ValueError(
                f"trainer.hosts ({self.trainer.hosts}) exceeds the hosts in provisioner.hosts "
                f"({len(self.provisioner.hosts)}): start a `python -m forge.worker` per host and list them there"
            )
        self._check_host_spans()
        self._check_token_advantages()
        if self.replay_buffer.batch_size % self.dp_size:
            raise ValueError(
                f"replay_buffer.batch_size ({self.replay_buffer.batch_size}) must be a multiple of the "
                f"trainer's data-parallel size ({self.dp_size}, from trainer.procs and "
                "trainer.engine.parallelism): each data-parallel rank trains on an equal share"
            )
        if self.env is not None and (self.env.max_tokens or 0) > self.trainer.engine.training.seq_len:
            raise ValueError(
                f"env.max_tokens ({self.env.max_tokens}) exceeds trainer.engine.training.seq_len "
                f"({self.trainer.engine.training.seq_len}): the trainer could not read whole trajectories"
            )
        self._check_sleep_mode()
        self._check_lora_sync()

    def _check_lora_sync(self) -> None:
        if self.trainer.enabled and self.trainer.engine.lora is not None:
            # The generators apply the trainer's adapters to their own checkpoint: it must be the
            # base the trainer adapts (before adapter sync a generator's weights were replaced whole).
            model = self.trainer.engine.model
            trainer_base = model.hf_path if "hf_path" in model.model_fields_set else self.policy_path
            generator_base = self.generator.model_path or self.policy_path
            if trainer_base is not None and os.path.realpath(trainer_base) != os.path.realpath(
                generator_base
            ):
                raise ValueError(
                    f"generator.model_path ({generator_base}) differs from trainer.engine.model.hf_path "
                    f"({trainer_base}): with trainer.engine.lora the generators receive the adapters alone "
                    "and apply them to their own checkpoint, which must be the trainer's base; leave "
                    "generator.model_path unset"
                )
        mode = self.generator.lora_sync
        if mode is None:
            return
        if self.trainer.engine.lora is None or not self.trainer.enabled:
            raise ValueError(
                f"generator.lora_sync={mode} says how generators take the trainer's LoRA adapters, and "
                "trainer.engine.lora is not set (or trainer.enabled is false): set trainer.engine.lora, "
                "or remove generator.lora_sync"
            )
        if mode == "vllm_lora" and resolve_engine(self.generator.engine) != "vllm":
            raise ValueError(
                f"generator.lora_sync=vllm_lora needs the vLLM engine, and generator.engine="
                f"{self.generator.engine} takes the native (hf) engine here (no CUDA or no vllm): set "
                "generator.engine=vllm, or generator.lora_sync=merge"
            )

    def _check_token_advantages(self) -> None:
        rollout = self.rollout
        if rollout.kl_coef and rollout.advantage not in ("reinforce_pp", "gae"):
            raise ValueError(
                f"rollout.kl_coef ({rollout.kl_coef}) is a KL penalty in the token rewards, and "
                f"rollout.advantage is {rollout.advantage}: set rollout.advantage=reinforce_pp or gae, or "
                "put a KL term in the loss (trainer.loss.beta) instead"
            )
        if rollout.advantage == "gae" and self.critic is None:
            raise ValueError(
                "rollout.advantage=gae needs a critic: add a `critic` section (critic.path defaults to "
                "the policy's checkpoint)"
            )
        if self.critic is not None and rollout.advantage != "gae":
            raise ValueError(
                f"critic is set and rollout.advantage is {rollout.advantage}: only gae uses a critic's "
                "values; set rollout.advantage=gae, or remove the critic section"
            )
        if self.critic is not None and self.trainer.engine.parallelism.tensor_parallel_degree > 1:
            raise ValueError(
                "critic: the value model does not support trainer.engine.parallelism.tensor_parallel_degree "
                "> 1 (its one-row head cannot be split): use data parallelism, or remove the critic"
            )
        if self.critic is not None and not self.trainer.enabled:
            raise ValueError("critic: trains beside the trainer, and trainer.enabled is false: remove it")
        if rollout.group_size == 1 and rollout.advantage in ("grpo", "dr_grpo", "rloo"):
            raise ValueError(
                f"rollout.group_size=1 with rollout.advantage={rollout.advantage}: a group advantage of "
                "one completion is 0; use group_size >= 2, or rollout.advantage=gae (with a critic) or "
                "reinforce_pp"
            )
        if (
            rollout.group_size == 1
            and rollout.skip_groups_without_signal
            and ("skip_groups_without_signal" in rollout.model_fields_set)
        ):
            raise ValueError(
                "rollout.skip_groups_without_signal=true drops every group of one completion "
                "(rollout.group_size=1): set it false"
            )
        if rollout.kl_coef and self.reference.enabled == "off":
            raise ValueError(
                f"rollout.kl_coef ({rollout.kl_coef}) needs the reference model, and reference.enabled is "
                "off: set reference.enabled to auto or on, or rollout.kl_coef=0"
            )
        rewards = self.reward.functions or self.reward.remote or self.reward.models
        if (
            self.distill is not None
            and not rewards
            and rollout.skip_groups_without_signal
            and "skip_groups_without_signal" in rollout.model_fields_set
        ):
            raise ValueError(
                "rollout.skip_groups_without_signal=true drops every group of a run with no reward (reward."
                "functions is empty): the teacher's signal (distill) is all it has; set it false"
            )

    def _check_sleep_mode(self) -> None:
        """vLLM sleeping through train steps only fits a serial pipeline on one shared GPU."""
        if not self.generator.vllm.sleep_during_train:
            return
        problems = []
        if self.replay_buffer.max_policy_age != 0:
            problems.append(
                f"replay_buffer.max_policy_age is {self.replay_buffer.max_policy_age} (rollouts would "
                "run during train steps, and vLLM can only sleep between them): use 0"
            )
        if self.generator.replicas != 1:
            problems.append(f"generator.replicas is {self.generator.replicas}: use 1")
        if not self.provisioner.colocate:
            problems.append("provisioner.colocate is false (the trainer has a GPU of its own): set it true")
        if problems:
            raise ValueError("generator.vllm.sleep_during_train=true: " + "; ".join(problems))

    def _check_host_spans(self) -> None:
        """The trainer, the reference model and the critic (which have the trainer's processes and
        hosts) each span trainer.hosts hosts: the first that many of their placement, consecutive ones."""
        actors = (
            (["TitanTrainer"] if self.trainer.enabled else [])
            + (["ReferenceModel"] if self.reference_actor else [])
            + (["Critic"] if self.critic is not None else [])
        )
        count = self.trainer.hosts
        for actor in actors:
            listed = self.provisioner.placement_for(actor)
            if listed[:count] != list(range(listed[0], listed[0] + count)):
                follows = " (or leave it out: it follows TitanTrainer's)" if actor != "TitanTrainer" else ""
                raise ValueError(
                    f"provisioner.placement.{actor} ({listed}) must begin with trainer.hosts ({count}) "
                    f"consecutive host indices, the hosts its processes span: list them in order{follows}"
                )

    def _resolve(self) -> None:
        """Sets, once, each setting left unset whose value follows from others (an explicit value
        stays, and `_check` has refused one that disagrees): the one place that writes into a
        section from another, so that a config file never needs to copy a value."""
        # `null` switches either file off.
        if "jsonl_path" not in self.metrics.model_fields_set:
            self.metrics.jsonl_path = f"{self.output_dir}/metrics.jsonl"
        if "rollouts_path" not in self.metrics.model_fields_set:
            self.metrics.rollouts_path = f"{self.output_dir}/rollouts.jsonl"
        if self.generator.model_path is None:
            self.generator.model_path = self.policy_path
        # The trainer (and the reference) start from the policy; an explicit null builds the
        # model of trainer.engine.model's flavor, randomly initialised.
        if "hf_path" not in self.trainer.engine.model.model_fields_set:
            self.trainer.engine.model.hf_path = self.policy_path
        if "seed" not in self.generator.sampling.model_fields_set:
            # The run's seed reaches the sampling (each sample seeded by its prompt and index);
            # an explicit null keeps per-sample seeds off (samples then depend on the batching).
            self.generator.sampling.seed = self.seed
        signal_without_spread = (
            self.distill is not None or self.rollout.advantage == "gae" or self.rollout.group_size == 1
        )
        if signal_without_spread and "skip_groups_without_signal" not in self.rollout.model_fields_set:
            # The teacher's signal, or the critic's baseline, is in every group, whatever its
            # rewards; a group of one never has a spread.
            self.rollout.skip_groups_without_signal = False
        if self.critic is not None:
            # The critic's optimizer takes the trainer's settings it does not set itself.
            unset = self.trainer.engine.optimizer.model_dump(exclude=self.critic.optimizer.model_fields_set)
            self.critic.optimizer = self.critic.optimizer.model_copy(update=unset)
        loss, derived = self.trainer.loss, {}
        # The loss recomputes the generator's logprobs, at the generator's temperature.
        if "temperature" in type(loss).model_fields and "temperature" not in loss.model_fields_set:
            derived["temperature"] = self.generator.sampling.temperature
        # fixed_horizon divides by the longest possible response, not by each batch's width.
        if loss.agg_type == "fixed_horizon" and loss.horizon is None:
            derived["horizon"] = (
                self.trainer.engine.training.seq_len
                if self.agent is not None
                else self.generator.sampling.max_tokens
                if self.env is None
                else self.trajectory_limits.max_tokens
            )
        if derived:
            self.trainer.loss = loss.model_copy(update=derived)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks of the trainer: its procs on all its hosts, less the tensor-parallel groups."""
        try:
            return self.trainer.engine.parallelism.dp_degree(self.trainer.procs * self.trainer.hosts)
        except ValueError as error:
            raise ValueError(f"trainer.engine.{error} (trainer.procs)") from None

    @property
    def trajectory_limits(self):
        """Turns and tokens per trajectory (forge.rollout.groups): one turn without an environment."""
        from forge.rollout.groups import TrajectoryLimits

        if self.env is None:
            return TrajectoryLimits()
        return self.env.limits(self.trainer.engine.training.seq_len)

    @property
    def use_reference(self) -> bool:
        if self.reference.enabled == "auto":
            return getattr(self.trainer.loss, "beta", 0.0) > 0 or self.rollout.kl_coef > 0
        return self.reference.enabled == "on"

    @property
    def teacher_engine(self) -> TitanEngineConfig | None:
        """The teacher's engine (None without distill): the trainer's, with the teacher's
        checkpoint deciding the model, scoring the ids the policy samples, and no adapters."""
        if self.distill is None:
            return None
        model = ModelConfig(
            hf_path=self.distill.teacher_path, sampled_rows=self.trainer.engine.model.sampled_rows
        )
        update = {"model": model, "lora": None}
        if self.distill.gpu == "own":  # its own processes: sharded over them alone
            update["parallelism"] = ParallelismConfig()
        return self.trainer.engine.model_copy(update=update)

    @property
    def critic_engine(self) -> TitanEngineConfig | None:
        """The critic's engine (None without a critic): the trainer's, with the critic's
        checkpoint (default: the policy's model), its optimizer, and no adapters."""
        if self.critic is None:
            return None
        model = self.trainer.engine.model
        if self.critic.path is not None:
            model = ModelConfig(hf_path=self.critic.path, sampled_rows=model.sampled_rows)
        return self.trainer.engine.model_copy(
            update={"model": model, "optimizer": self.critic.optimizer, "lora": None}
        )

    @property
    def token_advantages(self):
        """How episodes get per-token advantages (forge.rollout.token_advantages); None: they train
        on their group advantage alone."""
        from forge.rollout.token_advantages import GAE, TokenAdvantages

        if self.rollout.advantage not in ("reinforce_pp", "gae") and self.distill is None:
            return None
        critic = self.critic
        return TokenAdvantages(
            reinforce_pp=self.rollout.advantage == "reinforce_pp",
            gae=GAE(critic.gamma, critic.lam) if self.rollout.advantage == "gae" else None,
            kl_coef=self.rollout.kl_coef,
            distill_weight=self.distill.weight if self.distill is not None else 0.0,
        )

    @property
    def adapter_sync(self) -> AdapterSync | None:
        """With LoRA, what the generators need to take the adapters the trainer publishes alone
        (`forge.engines.lora_sync`); None without."""
        if not self.trainer.enabled or self.trainer.engine.lora is None:
            return None
        return AdapterSync.of(self.trainer.engine, self.generator.lora_sync or "merge")

    @property
    def reference_in_trainer(self) -> bool:
        """Whether the trainer is the reference model: with LoRA the reference is the base model,
        the trainer's own with its adapters off (`TitanTrainer.reference_logprobs`), and no
        ReferenceModel actor runs. Without a trainer (rollout-only) a ReferenceModel runs."""
        return self.use_reference and self.trainer.enabled and self.trainer.engine.lora is not None

    @property
    def reference_actor(self) -> bool:
        """Whether a ReferenceModel actor runs (a reference the trainer does not provide)."""
        return self.use_reference and not self.reference_in_trainer
