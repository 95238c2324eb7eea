"""The engines on a GPU, without Monarch: TorchTitan (CUDA, NCCL) and the transformers
generation engine. Prints a table.

1. Parity: a float32 `small` qwen3 trains two GRPO steps on its own samples; its weights are
   loaded into the generation engine (as the weight sync does); the generator's reported
   logprobs must equal the trainer's `compute_logprobs` on the same tokens.
2. Throughput at Qwen3-0.6B size (torchtitan's `0.6B` flavor, random weights: no checkpoint
   can be downloaded there): trainer tokens/s (bf16 compute, SFT loss) and generation tokens/s.

    PYTHONPATH=src python bench/gpu_engines_check.py
"""

import tempfile
import time

import torch

from forge.data.types import Completion, Episode
from forge.engines.generation import SamplingParams
from forge.engines.hf_generate import HFGenerateEngine
from forge.engines.titan.config import TitanEngineConfig
from forge.engines.titan.engine import TitanEngine
from forge.rl.batch import PolicyBatch
from forge.rl.losses import build_loss
from forge.rl.ops import compute_logprobs

VOCAB = 1024


def engine(flavor: str, vocab: int | None, **training) -> TitanEngine:
    return TitanEngine(
        TitanEngineConfig.model_validate(
            {
                "model": {"flavor": flavor, "vocab_size": vocab},
                "training": {"seq_len": 2048, **training},
                "optimizer": {"lr": 1e-3},
            }
        )
    )


def episodes(groups, prompts) -> list[Episode]:
    return [
        Episode(
            Completion("p", list(p), s.token_ids, s.logprobs, "", s.stop_reason, 0),
            "t",
            str(g),
            advantage=1.0 if i % 2 else -1.0,
        )
        for g, (p, group) in enumerate(zip(prompts, groups, strict=True))
        for i, s in enumerate(group)
    ]


def parity() -> float:
    trainer = engine("small", VOCAB)
    with tempfile.TemporaryDirectory() as tmp:
        generator = HFGenerateEngine.from_pretrained(trainer.export_hf(f"{tmp}/policy"), device="cuda")
    grpo = build_loss("grpo")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]
    params = SamplingParams(n=4, max_tokens=16, seed=0)
    for _ in range(2):
        batch = PolicyBatch.from_episodes(episodes(generator.generate(prompts, params), prompts), pad_id=0)
        trainer.train_step(batch, grpo)
        generator.load_hf_state_dict(trainer.hf_state_dict())
    batch = PolicyBatch.from_episodes(episodes(generator.generate(prompts, params), prompts), pad_id=0)
    ours = compute_logprobs(trainer.forward(batch.tokens), batch.target_ids.cuda()).cpu()
    return float(((ours - batch.generator_logprobs).abs() * batch.loss_mask).max())


def throughput() -> tuple[float, float, int]:
    trainer = engine("0.6B", None, mixed_precision_param="bfloat16")
    params = sum(p.numel() for p in trainer.model.parameters())
    sft = build_loss("sft")
    tokens = torch.randint(0, 150_000, (8, 1024))
    batch = PolicyBatch(target_ids=tokens.roll(-1, 1), loss_mask=torch.ones(8, 1024), tokens=tokens)
    for _ in range(2):  # warm-up
        trainer.train_step(batch, sft)
    torch.cuda.synchronize()
    started, steps = time.perf_counter(), 5
    for _ in range(steps):
        trainer.train_step(batch, sft)
    torch.cuda.synchronize()
    train_tps = steps * tokens.numel() / (time.perf_counter() - started)

    with tempfile.TemporaryDirectory() as tmp:
        generator = HFGenerateEngine.from_pretrained(
            trainer.export_hf(f"{tmp}/policy"), device="cuda", dtype=torch.bfloat16
        )
    del trainer
    prompts = [
        torch.randint(0, 150_000, (64,), generator=torch.Generator().manual_seed(i)).tolist()
        for i in range(64)
    ]
    sampling = SamplingParams(n=8, max_tokens=128, seed=0, stop_token_ids=[])
    generator.generate(prompts[:4], sampling.model_copy(update={"max_tokens": 8}))  # warm-up
    torch.cuda.synchronize()
    started = time.perf_counter()
    out = generator.generate(prompts, sampling)
    torch.cuda.synchronize()
    gen_tps = sum(len(s.token_ids) for group in out for s in group) / (time.perf_counter() - started)
    return train_tps, gen_tps, params


def main() -> None:
    print(f"forge engines on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    diff = parity()
    train_tps, gen_tps, params = throughput()
    print("| check | result |")
    print("|---|---|")
    print(
        f"| parity after 2 GRPO steps + weight load (qwen3 small, float32) | max abs logprob diff {diff:.2e} |"
    )
    print(
        f"| TitanEngine train, qwen3 0.6B ({params / 1e6:.0f}M params), bf16 compute, 8x1024 tokens | {train_tps:,.0f} tokens/s |"
    )
    print(
        f"| HFGenerateEngine, same weights in bf16, 64 prompts x 8 samples x 128 tokens | {gen_tps:,.0f} tokens/s |"
    )


if __name__ == "__main__":
    main()
