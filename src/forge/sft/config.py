"""The SFT run's configuration: validated at start-up, before any process starts."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from forge.config import ForgeConfigModel
from forge.engines.titan.config import TitanEngineConfig
from forge.observability import MetricsConfig
from forge.recipes.sft import SFTRecipeDataConfig
from forge.rewards.functions import RewardFnName
from forge.rl.losses import SFTLossConfig
from forge.runs.checkpoint import CheckpointConfig


class TrainerSection(ForgeConfigModel):
    procs: int = Field(1, ge=1, description="data-parallel trainer processes (one proc mesh)")
    threads: int | None = Field(
        None, ge=1, description="torch threads per trainer process; default: the CPU cores / procs"
    )
    engine: TitanEngineConfig = TitanEngineConfig()
    loss: SFTLossConfig = SFTLossConfig()


class GenerationEvalConfig(ForgeConfigModel):
    """Greedy generation on the eval split's prompts with the exported model, scored by a reward
    function: the fraction that gets the full reward is the run's final exact-match accuracy."""

    reward_fn: RewardFnName = "toy_task"
    max_tokens: int = Field(8, ge=1)
    num_prompts: int | None = Field(None, ge=1, description="the first N eval prompts; all when unset")
    target_column: str = "target"


class SFTConfig(ForgeConfigModel):
    run_dir: str = Field(description="checkpoints, metrics.jsonl, config.yaml and written data go here")
    tokenizer_path: str | None = Field(
        None,
        description="a local tokenizer dir or hub id; unset: the checkpoint's (trainer.engine.model.hf_path); "
        "with data.embedded_task the embedded one is used",
    )
    max_steps: int = Field(ge=1)
    log_every: int = Field(10, ge=1, description="a plain progress line every N steps (off a terminal)")
    eval_every: int = Field(
        0, ge=0, description="held-out loss every N steps (0: only before step 1 and at the end)"
    )
    eval_batch_size: int | None = Field(None, ge=1, description="default: data.batch_size")
    # Run checkpoints under run_dir/checkpoints, as GRPO's (forge.runs.checkpoint).
    checkpoint: CheckpointConfig = CheckpointConfig()
    resume: bool | Literal["auto"] = Field(
        False,
        description="continue from the newest intact checkpoint in run_dir/checkpoints: true needs one, "
        "auto continues from one if there is one, else starts",
    )
    export_dir: str | None = Field(
        None,
        description="written at the end: the Hugging Face model, or with trainer.engine.lora the PEFT "
        "adapter (adapter_config.json, adapter_model.safetensors) for trainer.engine.model.hf_path",
    )
    export_merged: bool = Field(
        False,
        description="with trainer.engine.lora, also the merged Hugging Face model (the base with the "
        "adapters added into its weights), in export_dir/merged",
    )
    trainer: TrainerSection = TrainerSection()
    data: SFTRecipeDataConfig
    generation_eval: GenerationEvalConfig | None = None
    # Backends besides run_dir/metrics.jsonl, which is always written (the app sets jsonl_path).
    metrics: MetricsConfig = MetricsConfig(console=False)

    @model_validator(mode="after")
    def _consistent(self) -> SFTConfig:
        if self.metrics.jsonl_path is not None or self.metrics.rollouts_path is not None:
            raise ValueError(
                "metrics.jsonl_path and metrics.rollouts_path are not SFT settings: the metrics "
                "always go to run_dir/metrics.jsonl, and SFT generates no rollouts"
            )
        if self.data.embedded_task is not None and self.tokenizer_path is not None:
            raise ValueError("data.embedded_task brings its own tokenizer: leave tokenizer_path unset")
        dp_size = self.trainer.engine.parallelism.dp_degree(self.trainer.procs)
        if self.data.batch_size % dp_size:
            raise ValueError(
                f"data.batch_size ({self.data.batch_size}) must be a multiple of the trainer's "
                f"data-parallel size ({dp_size}, from trainer.procs and trainer.engine.parallelism): "
                "each data-parallel rank trains on an equal share"
            )
        if self.data.max_seq_len > self.trainer.engine.training.seq_len:
            raise ValueError(
                f"data.max_seq_len ({self.data.max_seq_len}) exceeds trainer.engine.training.seq_len "
                f"({self.trainer.engine.training.seq_len}), the longest sequence the model accepts"
            )
        self._check_lora_exports()
        if self.generation_eval is not None:
            if self.export_dir is None:
                raise ValueError("generation_eval runs on the exported model: set export_dir")
            if self.model_export_dir is None:
                raise ValueError(
                    "generation_eval runs on the exported model, and with trainer.engine.lora export_dir "
                    "holds the adapter alone: set export_merged: true (it runs on export_dir/merged)"
                )
            if self.data.embedded_task is None and self.data.eval_path is None:
                raise ValueError("generation_eval reads prompts and targets from data.eval_path: set it")
        return self

    def _check_lora_exports(self) -> None:
        lora, hf_path = self.trainer.engine.lora, self.trainer.engine.model.hf_path
        if lora is not None and hf_path is None:
            raise ValueError(
                "trainer.engine.lora adapts a pretrained model, which its adapter export loads onto: set "
                "trainer.engine.model.hf_path to a checkpoint, or unset trainer.engine.lora"
            )
        if self.export_merged and (lora is None or self.export_dir is None):
            raise ValueError(
                "export_merged writes a LoRA run's merged model into export_dir/merged: it needs "
                "trainer.engine.lora and export_dir (without lora, export_dir is the whole model already)"
            )

    @property
    def model_export_dir(self) -> Path | None:
        """Where the whole Hugging Face model is exported: export_dir, or with LoRA
        export_dir/merged when export_merged is set; None when no whole model is exported."""
        if self.export_dir is None:
            return None
        if self.trainer.engine.lora is None:
            return Path(self.export_dir)
        return Path(self.export_dir) / "merged" if self.export_merged else None
