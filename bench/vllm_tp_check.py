"""vLLM with tensor parallelism (issue 22, run 4): generation, in-place weight updates and logprob
parity with the trainer, through forge's `VLLMEngine` in this process. Prints a table.

    PYTHONPATH=src:. python bench/vllm_tp_check.py --out DIR [--size 0.6B] [--tp 2] [--dtype bfloat16]

A random policy of torchtitan's `size` flavor is exported twice (seeds 0 and 1); the engine
starts on the first, samples, loads the second as version 1 (the samples' versions say so and
their logprobs must be the trainer's under it), then loads the first again as version 2: with
the same seed it must sample exactly what it sampled before the first update, which no partial
or misplaced load across the TP ranks would give. Versions 1 and 3 are written into the engine's
receive buffers, as the generator actor receives them (with TP > 1: shared host memory that
each worker maps and reads); version 2 is a state dict on the GPU, which reaches the workers
pickled. Version 3 is version 1 again: its load is the shared path's steady state.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import torch

from forge.engines.generation import SamplingParams


def export(size: str, seed: int, out: Path, dtype: str) -> Path:
    from forge.data.tokenizer import embedded_tokenizer
    from forge.engines.titan.config import TitanEngineConfig
    from forge.engines.titan.engine import TitanEngine

    tokenizer_dir = out / "tokenizer"
    embedded_tokenizer().save_pretrained(tokenizer_dir)
    config = {"model": {"flavor": size}, "training": {"seq_len": 256, "dtype": dtype, "seed": seed}}
    engine = TitanEngine(TitanEngineConfig.model_validate(config), trainable=False)
    return engine.export_hf(out / f"policy_{seed}", tokenizer_dir)


def trainer_gap(policy: Path, prompts, samples, temperature: float, dtype: str) -> float:
    """Largest |generator - trainer| logprob over the samples, the trainer loaded from `policy`."""
    from forge.engines.titan.config import TitanEngineConfig
    from forge.engines.titan.engine import TitanEngine
    from forge.rl.ops import compute_logprobs

    config = {"model": {"hf_path": str(policy)}, "training": {"seq_len": 256, "dtype": dtype}}
    trainer = TitanEngine(TitanEngineConfig.model_validate(config), trainable=False)
    gap = 0.0
    for prompt, group in zip(prompts, samples, strict=True):
        for sample in group:
            tokens = torch.tensor([prompt + sample.token_ids[:-1]])
            targets = torch.tensor([prompt[1:] + sample.token_ids])
            logits = trainer.forward(tokens)
            expected = compute_logprobs(logits.float(), targets.to(logits.device), temperature)[
                0, len(prompt) - 1 :
            ]
            gap = max(gap, (torch.tensor(sample.logprobs) - expected.cpu()).abs().max().item())
    return gap


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", default="0.6B")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--kv-cache-gib", type=float, default=4.0)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from forge.engines.vllm import VLLMEngine
    from forge.engines.vllm_config import VLLMConfig

    first, second = (export(args.size, seed, args.out, args.dtype) for seed in (0, 1))
    config = VLLMConfig(
        tensor_parallel_size=args.tp, kv_cache_memory_gib=args.kv_cache_gib, max_model_len=256
    )
    started = time.perf_counter()
    engine = VLLMEngine(str(first), config, dtype=args.dtype)
    rows = [("start-up s", f"{time.perf_counter() - started:.1f}")]
    prompts = [[1, 5 + i, 6 + i, 7 + i] for i in range(8)]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=32, seed=0)
    before = engine.generate(prompts, params)

    received = engine.hf_state_dict_template()

    def load(path: Path, version: int, into_receive_buffers: bool) -> None:
        weights = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).state_dict()
        if into_receive_buffers:
            for name, tensor in received.items():
                tensor.copy_(weights[name])
            state_dict, how = received, "from the receive buffers"
        else:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            state_dict, how = {k: v.to(device) for k, v in weights.items()}, "a state dict elsewhere"
        asyncio.run(engine.load_hf_state_dict_async(state_dict, version))
        rows.append((f"load version {version} s, {how}", f"{engine.last_load_seconds:.3f}"))

    load(second, 1, into_receive_buffers=True)
    version, updated = asyncio.run(engine.generate_async(prompts, params))
    rows.append(("version the samples after load 1 report", str(version)))
    rows.append(
        (
            "max |generator - trainer| logprob, version 1",
            f"{trainer_gap(second, prompts, updated, 1.0, args.dtype):.4f}",
        )
    )
    rows.append(("samples changed by version 1", str(updated != before)))
    load(first, 2, into_receive_buffers=False)
    rows.append(
        (
            "version 2 (= version 0's weights) samples what version 0 sampled",
            str(engine.generate(prompts, params) == before),
        )
    )
    load(second, 3, into_receive_buffers=True)
    rows.append(
        (
            "version 3 (= version 1's weights) samples what version 1 sampled",
            str(asyncio.run(engine.generate_async(prompts, params))[1] == updated),
        )
    )
    engine.close()
    print(f"vLLM tensor_parallel_size={args.tp}, {args.size}, {args.dtype}")
    print("| check | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":  # vLLM starts worker processes for TP > 1: they import this module
    main()
