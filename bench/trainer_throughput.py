"""The trainer alone: `TitanEngine.train_step` with the GRPO loss on one random batch, per variant
of the engine's settings, on Qwen3-shaped models with random weights. Prints one row per run.

    PYTHONPATH=src python bench/trainer_throughput.py [--sizes 0.6B 1.7B] [--preset trl|varlen]
        [--variants padded-logits,packed,...] [--steps 3] [--profile DIR]

Presets (the batch of one optimizer step):
- `trl`: 512 sequences of 64 prompt + 256 response tokens (bench/gpu_throughput.py's `trl`).
- `varlen`: 512 sequences of 64 prompt tokens and responses whose lengths are drawn from a
  lognormal with a median of 300 tokens (sigma 0.8), capped at 2,048: a real math run's spread.

Variants (VARIANTS) differ only in engine settings; `padded-logits` is the engine as it was
before token scores and packing: the loss gets the full logits of padded rows of 16.

Columns: s/step (median of the timed steps after one warm-up), tokens/s (the sequences' own
tokens per second), MFU (forge.engines.titan.throughput's formula over the GPU's bf16 peak),
the forward/backward/optimizer split, padding (share of computed tokens that were padding),
peak GPU memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

VOCAB = 151_936
PROMPT = 64

VARIANTS: dict[str, dict] = {
    "padded-logits": {"training": {"packing": False, "microbatch_size": 16}, "logits": True},
    "padded-scores": {"training": {"packing": False, "microbatch_size": 16}},
    "packed-16k": {"training": {"microbatch_tokens": 16384}},
    "packed-32k": {"training": {"microbatch_tokens": 32768}},
    "packed-32k-fused": {"training": {"microbatch_tokens": 32768}, "optimizer": {"implementation": "fused"}},
    "packed-32k-fused-compile": {
        "training": {"microbatch_tokens": 32768, "compile": True},
        "optimizer": {"implementation": "fused"},
    },
    "packed-64k-fused-compile-sac": {
        "training": {"microbatch_tokens": 65536, "compile": True, "activation_checkpoint": "selective"},
        "optimizer": {"implementation": "fused"},
    },
    "padded-16-fused-compile": {
        "training": {"packing": False, "microbatch_size": 16, "compile": True},
        "optimizer": {"implementation": "fused"},
    },
    "padded-32k-fused-compile": {
        "training": {"packing": False, "microbatch_size": 64, "compile": True},
        "optimizer": {"implementation": "fused"},
    },
}


def response_lengths(preset: str, count: int, generator: torch.Generator) -> torch.Tensor:
    if preset == "trl":
        return torch.full((count,), 256)
    normal = torch.randn(count, generator=generator, dtype=torch.float64)
    return (300 * torch.exp(0.8 * normal)).round().clamp(1, 2048).long()


def make_batch(preset: str, rows: int, vocab: int, seed: int = 0):
    from forge.rl.batch import PolicyBatch

    generator = torch.Generator().manual_seed(seed)
    lengths = response_lengths(preset, rows, generator)
    width = PROMPT + int(lengths.max()) - 1
    tokens = torch.randint(0, vocab, (rows, width), generator=generator)
    target_ids = torch.randint(0, vocab, (rows, width), generator=generator)
    loss_mask = torch.zeros(rows, width)
    for row, length in enumerate(lengths.tolist()):
        loss_mask[row, PROMPT - 1 : PROMPT - 1 + length] = 1.0
    group_advantages = torch.randn(rows // 8, generator=generator).repeat_interleave(8)
    return PolicyBatch(
        target_ids=target_ids,
        loss_mask=loss_mask,
        tokens=tokens,
        advantages=group_advantages,
        generator_logprobs=-torch.rand(rows, width, generator=generator) * 3 * loss_mask,
    )


def engine_config(size: str, width: int, variant: dict, vocab: int, device_is_cuda: bool):
    from forge.engines.titan.config import TitanEngineConfig

    raw = {
        "model": {"flavor": size, "vocab_size": vocab},
        "optimizer": {"lr": 1e-6, **variant.get("optimizer", {})},
        "training": {
            "seq_len": width + width % 2,
            "mixed_precision_param": "bfloat16" if device_is_cuda else "float32",
            **variant.get("training", {}),
        },
    }
    return TitanEngineConfig.model_validate(raw)


def run_variant(size: str, preset: str, name: str, args) -> dict:
    from forge.engines.titan.engine import TitanEngine
    from forge.rl.losses import build_loss

    cuda = torch.cuda.is_available()
    variant = VARIANTS[name]
    batch = make_batch(preset, args.rows, args.vocab)
    engine = TitanEngine(engine_config(size, batch.tokens.shape[1], variant, args.vocab, cuda))
    grpo = build_loss("grpo", horizon=2048 if preset == "varlen" else 256)
    loss = (lambda logits, microbatch: grpo(logits, microbatch)) if variant.get("logits") else grpo
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    steps = [engine.train_step(batch, loss) for _ in range(args.steps + 1)][1:]
    if args.profile:
        profile_step(engine, batch, loss, args.profile / f"{size}-{preset}-{name}")
    row = {"size": size, "preset": preset, "variant": name}
    for key in ("step_s", "tokens_per_s", "mfu", "forward_s", "backward_s", "optimizer_s", "padding_frac"):
        values = [m[f"trainer/{key}"] for m in steps if f"trainer/{key}" in m]
        row[key] = statistics.median(values) if values else None
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    row["tokens"] = int(batch.sequence_lengths().sum())
    del engine
    if cuda:
        torch.cuda.empty_cache()
    return row


def profile_step(engine, batch, loss, out: Path) -> None:
    """One profiled step: kernel launches, and the ten costliest kernels by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        engine.train_step(batch, loss)
    events = prof.key_averages()
    launches = sum(
        e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
    )
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    (out / "top_ops.txt").write_text(
        f"kernel launches: {launches}\n" + events.table(sort_by=sort, row_limit=25)
    )


def print_table(rows: list[dict]) -> None:
    def show(value, fmt):
        return "-" if value is None else format(value, fmt)

    header = f"{'size':>5} {'preset':>6} {'variant':<30} {'s/step':>7} {'tok/s':>8} {'MFU':>6} {'fwd s':>6} {'bwd s':>6} {'opt s':>6} {'pad':>5} {'GiB':>6}"
    print(header)
    for r in rows:
        print(
            f"{r['size']:>5} {r['preset']:>6} {r['variant']:<30} {show(r['step_s'], '.2f'):>7} "
            f"{show(r['tokens_per_s'], ',.0f'):>8} {show(r['mfu'] and 100 * r['mfu'], '.1f'):>6} "
            f"{show(r['forward_s'], '.2f'):>6} {show(r['backward_s'], '.2f'):>6} {show(r['optimizer_s'], '.2f'):>6} "
            f"{show(r['padding_frac'], '.2f'):>5} {show(r['peak_gib'], '.1f'):>6}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=["0.6B"])
    parser.add_argument("--preset", choices=["trl", "varlen"], default="trl")
    parser.add_argument("--variants", type=lambda text: text.split(","), default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--rows", type=int, default=512, help="sequences per optimizer step")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--profile", type=Path, default=None, help="also profile one step per run into DIR")
    parser.add_argument("--json", type=Path, default=None, help="append the rows to this file")
    args = parser.parse_args()
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    rows = []
    for size in args.sizes:
        for name in args.variants:
            try:
                rows.append(run_variant(size, args.preset, name, args))
            except torch.OutOfMemoryError as error:
                print(f"{size} {name}: out of memory ({str(error).splitlines()[0]})", flush=True)
                torch.cuda.empty_cache()
                continue
            print_table(rows[-1:])
            if args.json:
                with args.json.open("a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
    print()
    print_table(rows)


if __name__ == "__main__":
    main()
