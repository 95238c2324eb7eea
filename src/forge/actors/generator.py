"""Generator: samples completions with per-token logprobs; loads new weights from the store.

Monarch runs one endpoint call of an actor at a time, so `update_weights` never lands in
the middle of a `generate`: requests already running finish on the old weights, and every
`Completion` carries the version that produced all of its tokens.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from monarch.actor import endpoint
from pydantic import Field

from forge import store
from forge.config import ForgeConfigModel
from forge.controller import ForgeActor
from forge.data.types import Completion
from forge.engines.generation import SamplingParams
from forge.observability import Reduce, record_metric


class GeneratorConfig(ForgeConfigModel):
    # A local Hugging Face directory (config.json, *.safetensors, tokenizer files).
    model_path: str
    # The engine behind the `GenerationEngine` interface. Only the native transformers engine
    # exists so far; a vLLM engine plugs in here by implementing the same interface.
    engine: Literal["hf"] = "hf"
    dtype: Literal["float32", "bfloat16"] = "float32"
    sampling: SamplingParams = SamplingParams()
    # More than 1 runs the generators as a service: a replica that dies is replaced, and the
    # replacement loads the newest published weights before it serves.
    replicas: int = Field(1, ge=1)


def build_generation_engine(cfg: GeneratorConfig, eos_token_id: int | None):
    """The engine named by `cfg.engine` (engines are imported lazily, only when chosen)."""
    import torch
    from transformers import AutoModelForCausalLM

    from forge.engines.hf_generate import HFGenerateEngine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=getattr(torch, cfg.dtype)).to(device)
    # The tokenizer's eos is authoritative: an exported config.json may not carry one.
    return HFGenerateEngine(model, eos_token_id=eos_token_id)


class Generator(ForgeActor):
    def __init__(self, cfg: GeneratorConfig):
        self.cfg = cfg
        self.version = 0

    @endpoint
    async def setup(self) -> None:
        from transformers import AutoTokenizer

        from forge.engines.generation import check_model_dir

        check_model_dir(self.cfg.model_path, "generator.model_path")
        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model_path)
        self.engine = build_generation_engine(self.cfg, self.tokenizer.eos_token_id)
        self._weights = None  # receive buffers, allocated on the first update
        # A replica that replaces a dead one starts from the policy being trained, not model_path.
        newest = await store.latest_version()
        if newest is not None:
            await self._load_version(newest)

    @endpoint
    async def generate(self, prompt: str, **sampling: Any) -> list[Completion]:
        """`n` completions of `prompt` (sampling defaults from config, overridden by kwargs)."""
        return self._generate([prompt], sampling)[0]

    @endpoint
    async def generate_batch(self, prompts: list[str], **sampling: Any) -> list[list[Completion]]:
        """`n` completions of each prompt, sampled together in one batch."""
        return self._generate(prompts, sampling)

    def _generate(self, prompts: list[str], overrides: dict[str, Any]) -> list[list[Completion]]:
        # Overrides are validated like config: an unknown or bad sampling key fails here.
        params = SamplingParams.model_validate({**self.cfg.sampling.model_dump(), **overrides})
        prompt_ids = [self.tokenizer(p).input_ids for p in prompts]
        started = time.perf_counter()
        outputs = self.engine.generate(prompt_ids, params)
        elapsed = time.perf_counter() - started
        tokens = sum(len(seq.token_ids) for group in outputs for seq in group)
        record_metric("generator/tokens_per_s", tokens / max(elapsed, 1e-9), Reduce.MEAN)
        record_metric("generator/generated_tokens", tokens, Reduce.SUM)
        return [
            [
                Completion(
                    prompt=prompt,
                    prompt_ids=list(ids),
                    response_ids=seq.token_ids,
                    logprobs=seq.logprobs,
                    text=self.tokenizer.decode(seq.token_ids, skip_special_tokens=True),
                    stop_reason=seq.stop_reason,
                    policy_version=self.version,
                )
                for seq in group
            ]
            for prompt, ids, group in zip(prompts, prompt_ids, outputs, strict=True)
        ]

    @endpoint
    async def update_weights(self, version: int) -> None:
        """Loads `version` from the store into preallocated buffers, then into the engine."""
        if version != self.version:
            await self._load_version(version)

    async def _load_version(self, version: int) -> None:
        started = time.perf_counter()
        if self._weights is None:
            self._weights = self.engine.hf_state_dict_template()
        await store.get_state_dict(version, into=self._weights)
        self.engine.load_hf_state_dict(self._weights)
        self.version = version
        record_metric("generator/weight_sync_ms", (time.perf_counter() - started) * 1e3, Reduce.MEAN)

    @endpoint
    async def get_version(self) -> int:
        return self.version
