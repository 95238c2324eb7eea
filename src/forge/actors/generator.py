"""Generator: samples completions with per-token logprobs; loads new weights from the store.

Monarch runs one endpoint call of an actor at a time, so `update_weights` never lands in
the middle of a `generate`: requests already running finish on the old weights, and every
`Completion` carries the version that produced all of its tokens.

With `sampling.seed` set, a sample is seeded by (seed, its prompt's sample key, its index):
the rollout passes each prompt's position in the dataset's stream as its key, so a run
draws the same samples however its prompts are batched, and a resumed run continues them.
Calls without keys use the ordinal of the call instead.

Weights: before each request the generator loads the newest complete version in the store,
if there is a newer one (`forge.weight_sync.WeightPuller`); a request can ask for at least
`min_version` and then waits for it. `update_weights(v)` loads exactly `v`.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from monarch.actor import endpoint

from forge.config import ForgeConfigModel
from forge.controller import ForgeActor
from forge.data.types import Completion
from forge.engines.generation import SamplingParams, sample_seed, to_completions
from forge.observability import Reduce, record_metric
from forge.weight_sync import WeightPuller, build_transport


class GeneratorConfig(ForgeConfigModel):
    # A local Hugging Face directory (config.json, *.safetensors, tokenizer files).
    model_path: str
    # The engine behind the `GenerationEngine` interface. Only the native transformers engine
    # exists so far; a vLLM engine plugs in here by implementing the same interface.
    engine: Literal["hf"] = "hf"
    dtype: Literal["float32", "bfloat16"] = "float32"
    sampling: SamplingParams = SamplingParams()
    # How new weights reach this generator (forge.weight_sync): auto is cuda_ipc when the run
    # has GPUs (trainer and generator on one host), store otherwise.
    weight_transport: Literal["auto", "store", "cuda_ipc"] = "auto"


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
        self._unkeyed_calls = 0

    @endpoint
    async def setup(self) -> None:
        from transformers import AutoTokenizer

        from forge.engines.generation import check_model_dir

        check_model_dir(self.cfg.model_path, "generator.model_path")
        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model_path)
        self.engine = build_generation_engine(self.cfg, self.tokenizer.eos_token_id)
        self._weights = None  # receive buffers, allocated on the first update
        self._puller = WeightPuller(build_transport(self.cfg.weight_transport))

    @endpoint
    async def generate(self, prompt: str, min_version: int = 0, **sampling: Any) -> list[Completion]:
        """`n` completions of `prompt` (sampling defaults from config, overridden by kwargs)."""
        await self._pick_up_newest(min_version)
        return self._generate([prompt], None, sampling)[0]

    @endpoint
    async def generate_batch(
        self,
        prompts: list[str],
        sample_keys: list[int] | None = None,
        min_version: int = 0,
        **sampling: Any,
    ) -> list[list[Completion]]:
        """`n` completions of each prompt, sampled together in one batch; `sample_keys` (one
        per prompt) choose the seeded random streams (see the module docstring); the policy
        is the newest published one, and at least `min_version`."""
        await self._pick_up_newest(min_version)
        return self._generate(prompts, sample_keys, sampling)

    def _receive_buffers(self) -> dict:
        if self._weights is None:
            self._weights = self.engine.hf_state_dict_template()
        return self._weights

    async def _pick_up_newest(self, min_version: int) -> None:
        started = time.perf_counter()
        loaded = await self._puller.pull_newest(self.version, self._receive_buffers(), min_version)
        if loaded is not None:
            self.engine.load_hf_state_dict(self._weights)
            self.version = loaded
            record_metric("generator/weight_sync_ms", (time.perf_counter() - started) * 1e3, Reduce.MEAN)

    def _generate(
        self, prompts: list[str], sample_keys: list[int] | None, overrides: dict[str, Any]
    ) -> list[list[Completion]]:
        # Overrides are validated like config: an unknown or bad sampling key fails here.
        params = SamplingParams.model_validate({**self.cfg.sampling.model_dump(), **overrides})
        if sample_keys is None:
            sample_keys = [sample_seed(self._unkeyed_calls, i) for i in range(len(prompts))]
            self._unkeyed_calls += 1
        prompt_ids = [self.tokenizer(p).input_ids for p in prompts]
        started = time.perf_counter()
        outputs = self.engine.generate(prompt_ids, params, sample_keys)
        elapsed = time.perf_counter() - started
        tokens = sum(len(seq.token_ids) for group in outputs for seq in group)
        record_metric("generator/tokens_per_s", tokens / max(elapsed, 1e-9), Reduce.MEAN)
        record_metric("generator/generated_tokens", tokens, Reduce.SUM)
        return to_completions(prompts, prompt_ids, outputs, self.tokenizer, self.version)

    @endpoint
    async def update_weights(self, version: int) -> None:
        """Loads `version` (waiting for it to be published) into preallocated buffers, then
        into the engine."""
        if version == self.version:
            return
        started = time.perf_counter()
        await self._puller.pull(version, self._receive_buffers())
        self.engine.load_hf_state_dict(self._weights)
        self.version = version
        record_metric("generator/weight_sync_ms", (time.perf_counter() - started) * 1e3, Reduce.MEAN)

    @endpoint
    async def get_version(self) -> int:
        return self.version
