"""Memory and time of `compute_logprobs` (forward + backward) on bf16 logits, against the naive
float32 `log_softmax(...).gather(...)`, eager and under torch.compile. Prints a table.

    python bench/logprobs_bench.py                      # GPU: B=4, T=2048, V=151936 (Qwen3 vocab)
    python bench/logprobs_bench.py --batch 2 --seq 64 --vocab 4096   # a quick CPU run
"""

import argparse
import time

import torch

from forge.rl.ops import compute_logprobs


def naive_logprobs(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, target_ids[..., None]).squeeze(-1)


def measure(
    fn, logits: torch.Tensor, target_ids: torch.Tensor, device: str, repeats: int
) -> tuple[float, float]:
    """(peak extra memory in GiB over the logits and their gradient, best seconds per fwd+bwd)."""
    times = []
    peak = 0.0
    for _ in range(repeats + 1):  # the first run warms up (and compiles)
        leaf = logits.detach().requires_grad_(True)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        started = time.perf_counter()
        fn(leaf, target_ids).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
            # The gradient of the logits is unavoidable; count what comes on top of it.
            peak = (
                torch.cuda.max_memory_allocated() - base - leaf.grad.numel() * leaf.grad.element_size()
            ) / 2**30
        times.append(time.perf_counter() - started)
    return peak, min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(0)
    shape = (args.batch, args.seq, args.vocab)
    logits = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16) * 4
    target_ids = torch.randint(0, args.vocab, shape[:2], generator=g, device=device)

    reference = torch.log_softmax(logits.double(), dim=-1).gather(-1, target_ids[..., None]).squeeze(-1)
    variants = {
        "naive float32 log_softmax": naive_logprobs,
        "compute_logprobs (eager)": compute_logprobs,
        "compute_logprobs (torch.compile)": torch.compile(compute_logprobs, dynamic=False),
    }
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(
        f"logprobs of bf16 logits {list(shape)} on {name}, torch {torch.__version__}, best of {args.repeats}"
    )
    print("| variant | extra memory GiB | fwd+bwd ms | max abs error vs float64 |")
    print("|---|---:|---:|---:|")
    for label, fn in variants.items():
        peak, seconds = measure(fn, logits, target_ids, device, args.repeats)
        error = (fn(logits, target_ids).double() - reference).abs().max().item()
        memory = f"{peak:.2f}" if device == "cuda" else "n/a"
        print(f"| {label} | {memory} | {seconds * 1e3:.1f} | {error:.1e} |")


if __name__ == "__main__":
    main()
