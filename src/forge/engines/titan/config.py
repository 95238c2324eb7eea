"""Configuration of the TorchTitan engine: one pydantic model per section, unknown keys rejected.

Defaults suit the tiny CPU models of the tests and the embedded demo; a GPU run overrides
the model, the learning rate and the mixed precision. ``job_config.build_job_config`` turns
this into torchtitan's ``JobConfig``.
"""

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from forge.config.base import compiled_regex


class _Section(BaseModel):
    # Same contract as forge.config.ForgeConfigModel: a misspelled key fails at start-up, and
    # so does NaN or infinity in any number.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ModelConfig(_Section):
    """Which model the engine builds.

    With ``hf_path`` the checkpoint's ``config.json`` decides the model (architecture, sizes,
    RoPE, tying, vocabulary rows); ``name``, ``flavor`` and ``vocab_size`` are then optional,
    and any of them that is set must agree with the checkpoint (checked before start-up).
    Without ``hf_path`` the named flavor decides, with these defaults.
    """

    name: Literal["qwen3", "qwen2", "llama3"] = "qwen3"
    flavor: str = "tiny"
    """A flavor registered in ``forge.engines.titan.flavors`` or one of torchtitan's (e.g. ``0.6B``)."""
    hf_path: str | None = None
    """Local Hugging Face checkpoint directory (``config.json``, ``*.safetensors``)."""
    vocab_size: int | None = Field(default=None, gt=0)
    """Without ``hf_path``: overrides the flavor's vocabulary size. The apps refuse a model built
    this way whose rows differ from the tokenizer's tokens (the SFT app sets it from the tokenizer)."""
    sampled_rows: int | None = Field(default=None, gt=0)
    """The first vocabulary rows, the ids the generator samples: a checkpoint may have more rows
    than its tokenizer has tokens (Qwen pads them), and the generator never samples an id the
    tokenizer cannot decode. Token scores (logprobs, entropy) are then those of the softmax over
    these rows, the distribution the generator samples from. None: all rows. The GRPO app sets it
    to the generator's tokenizer size."""


# Adam's decay rate of a moment estimate: at 1 the estimate never leaves 0, and the bias
# correction divides by 1 - beta**t = 0.
_Beta = Annotated[float, Field(ge=0.0, lt=1.0)]


class OptimizerConfig(_Section):
    name: Literal["AdamW", "Adam"] = "AdamW"
    lr: float = Field(default=1e-3, gt=0)
    betas: tuple[_Beta, _Beta] = (0.9, 0.95)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    implementation: Literal["for-loop", "foreach", "fused"] = "foreach"


class LRSchedulerConfig(_Section):
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warmup from ``lr / warmup_steps`` to ``lr``."""
    decay_type: Literal["constant", "linear", "cosine", "sqrt"] = "constant"
    total_steps: int | None = Field(default=None, gt=0)
    """Length of the whole schedule; required by the decaying schedules."""
    min_lr_factor: float = Field(default=0.0, ge=0.0, le=1.0)
    """A decaying schedule ends at ``lr * min_lr_factor``."""

    @model_validator(mode="after")
    def _decay_needs_total_steps(self) -> "LRSchedulerConfig":
        if self.decay_type != "constant" and self.total_steps is None:
            raise ValueError(
                f"lr_scheduler.decay_type={self.decay_type!r} needs lr_scheduler.total_steps "
                "(the step at which the decay ends); set it or use decay_type='constant'"
            )
        return self


class ParallelismConfig(_Section):
    data_parallel_shard_degree: int = -1
    """FSDP degree; -1 takes every rank left after the other degrees."""
    data_parallel_replicate_degree: int = Field(default=1, ge=1)
    tensor_parallel_degree: int = Field(default=1, ge=1)
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"

    @model_validator(mode="after")
    def _shard_degree_valid(self) -> "ParallelismConfig":
        if self.data_parallel_shard_degree == 0 or self.data_parallel_shard_degree < -1:
            raise ValueError(
                f"parallelism.data_parallel_shard_degree={self.data_parallel_shard_degree}: "
                "use -1 (all remaining ranks) or a degree >= 1"
            )
        return self

    def dp_degree(self, world_size: int) -> int:
        """Data-parallel ranks (replicate * shard) among ``world_size`` processes. The ranks of a
        tensor-parallel group are one data-parallel rank: they read the same batch."""
        others = self.data_parallel_replicate_degree * self.tensor_parallel_degree
        shard = self.data_parallel_shard_degree
        shard = world_size // others if shard == -1 else shard
        if shard < 1 or shard * others != world_size:
            raise ValueError(
                f"parallelism: data_parallel_replicate_degree ({self.data_parallel_replicate_degree}) * "
                f"data_parallel_shard_degree ({self.data_parallel_shard_degree}) * tensor_parallel_degree "
                f"({self.tensor_parallel_degree}) must equal the world size ({world_size})"
            )
        return self.data_parallel_replicate_degree * shard


class TrainingConfig(_Section):
    seq_len: int = Field(default=2048, gt=0)
    """Longest sequence the engine accepts (it sizes the RoPE cache)."""
    microbatch_size: int | None = Field(default=None, gt=0)
    """Sequences per forward/backward when micro-batches are padded rows (``packing`` off, or a
    loss that needs the full logits); a larger batch is split and its gradients accumulated.
    None runs the whole batch at once. ``train_step(microbatch_size=...)`` overrides it."""
    packing: bool = True
    """Pack each micro-batch's sequences end to end in one row (no padding; attention within
    each sequence), with micro-batches formed by ``microbatch_tokens``. Off: padded rows."""
    microbatch_tokens: int | None = Field(default=None, gt=0)
    """With packing, the most tokens per forward/backward (a longer sequence gets one of its own).
    None: ``microbatch_size`` times the batch's longest sequence, the tokens a padded micro-batch
    would hold (the whole batch without ``microbatch_size``)."""
    max_norm: float = Field(default=1.0, gt=0)
    """Gradient clipping threshold (total L2 norm)."""
    seed: int = Field(default=0, ge=0)
    """Seeds the weight initialization (through torch's global RNG, as torchtitan does)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the parameters, gradients and optimizer state."""
    mixed_precision_param: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype for the forward/backward: FSDP's mixed precision, or without FSDP the weights
    cast to it once per step (``forge.engines.titan.compute_weights``)."""
    compile: bool = False
    activation_checkpoint: Literal["none", "full", "selective"] = "none"

    @property
    def frozen_dtype(self) -> str:
        """The dtype of weights that are never trained (LoRA's frozen base): the compute dtype
        where it is narrower than the parameters' (a weight that never changes needs no float32
        master copy, and compute casts it to that dtype anyway), else the parameters'."""
        if self.dtype == "float32" and self.mixed_precision_param == "bfloat16":
            return "bfloat16"
        return self.dtype


# The Hugging Face names of the decoder blocks' linear layers, in every architecture the engine
# builds (torchtitan's names: attention.wq/wk/wv/wo, feed_forward.w1/w3/w2).
LORA_LAYER_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(_Section):
    """LoRA (``forge.engines.titan.lora``): the base model is frozen and each adapted linear layer
    learns a low-rank update ``alpha / rank * B A``. Embeddings and the output layer are never
    adapted. A trainable engine only: an engine built with ``trainable=False`` (the reference
    model) is the base model."""

    rank: int = Field(default=8, gt=0)
    alpha: float = Field(default=16.0, gt=0)
    """The update is scaled by ``alpha / rank``."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input, in training passes only (scoring is deterministic)."""
    target_modules: str = "|".join(LORA_LAYER_NAMES)
    """A regular expression that the adapted layers' Hugging Face names match whole
    (``re.fullmatch``), among q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj;
    e.g. ``q_proj|v_proj``. Default: all seven."""

    @field_validator("target_modules")
    @classmethod
    def _matches_a_layer(cls, pattern: str) -> str:
        compiled = compiled_regex(pattern)
        if not any(compiled.fullmatch(name) for name in LORA_LAYER_NAMES):
            raise ValueError(
                f"matches none of the linear layers {', '.join(LORA_LAYER_NAMES)} (matched whole); "
                "name some of them, e.g. 'q_proj|v_proj'"
            )
        return pattern

    def targets(self) -> list[str]:
        """The Hugging Face names of the layers that get adapters."""
        return [name for name in LORA_LAYER_NAMES if re.fullmatch(self.target_modules, name)]


class TitanEngineConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = Field(default_factory=LRSchedulerConfig)
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    lora: LoraConfig | None = None
    """Train LoRA adapters on the frozen model instead of every weight; None: full training."""

    @model_validator(mode="after")
    def _seq_len_splits(self) -> "TitanEngineConfig":
        # torchtitan's parallelize asserts it (sequence parallelism splits a sequence evenly over
        # the TP ranks, and it reserves a factor 2 for context parallelism), even at TP degree 1.
        divisor = 2 * self.parallelism.tensor_parallel_degree
        if self.training.seq_len % divisor:
            raise ValueError(
                f"training.seq_len ({self.training.seq_len}) must be a multiple of 2 * "
                f"parallelism.tensor_parallel_degree ({divisor}), as torchtitan's sequence parallelism "
                "needs: round it up"
            )
        return self

    @model_validator(mode="after")
    def _lora_without_tensor_parallelism(self) -> "TitanEngineConfig":
        # The adapters are merged into the weights row by row, as FSDP shards both; tensor
        # parallelism also splits some weights by columns.
        if self.lora is not None and self.parallelism.tensor_parallel_degree > 1:
            raise ValueError(
                "lora does not support parallelism.tensor_parallel_degree > 1 yet: use data "
                "parallelism (data_parallel_shard_degree) or unset lora"
            )
        return self
