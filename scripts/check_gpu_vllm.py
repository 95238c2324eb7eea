"""The CUDA install's check: forge's vLLM engine samples a few tokens on the GPU from a tiny
random Qwen3 (made here by transformers; nothing is downloaded). Prints what it ran on."""

import tempfile

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from forge.engines.generation import SamplingParams
from forge.engines.vllm import VLLMEngine
from forge.engines.vllm_config import VLLMConfig


def main() -> None:
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=128,
        eos_token_id=255,
        architectures=["Qwen3ForCausalLM"],
    )
    with tempfile.TemporaryDirectory() as model_dir:
        Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(model_dir)
        engine = VLLMEngine(
            model_dir,
            # A small share: vLLM refuses to start unless that share of the GPU is free, and the
            # check must pass beside other work on the GPU.
            VLLMConfig(
                gpu_memory_utilization=0.05, kv_cache_memory_gib=0.5, max_model_len=64, enforce_eager=True
            ),
            dtype="bfloat16",
        )
        try:
            [[sample]] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
        finally:
            engine.close()
    if not sample.token_ids:
        raise SystemExit("vLLM sampled no token on the GPU")
    print(f"vLLM sampled {len(sample.token_ids)} tokens on {torch.cuda.get_device_name()}")


if __name__ == "__main__":
    main()
