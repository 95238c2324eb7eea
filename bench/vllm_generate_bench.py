"""The vLLM generation engine against plain vLLM and the native (hf) engine. Prints a table.

Qwen3-0.6B shape (torchtitan's `0.6B` flavor, random weights: nothing can be downloaded on the
GPU machines), bf16, 256 prompts x n=8, up to 256 new tokens, temperature 1:

- `plain`:  vLLM's `LLM.generate` in this process, with the settings forge's engine uses;
- `engine`: `forge.engines.vllm.VLLMEngine` in this process: one call, the same prompts as
            4 concurrent calls (continuous batching), and one in-place weight update;
- `actor`:  the `Generator` actor with `generator.engine=vllm`: 4 concurrent `generate`
            calls, as the rollout loops make them, and `update_weights` through the store;
- `hf`:     the `Generator` actor with `generator.engine=hf` (calls of `--hf-chunk` prompts);
- `sampling`: plain vLLM again, one `LLM`, what each sampling setting forge uses costs:
            per-request seeds (vLLM draws a seeded request's noise by itself, one kernel per
            request per step), logprobs, and the logit bias that keeps padded vocabulary rows
            out of the samples; tokens/s and the GPU's busy share for each (`--only` picks
            settings by name; with VLLM_ENABLE_V1_MULTIPROCESSING=1 in the environment vLLM's
            engine core runs in a process of its own, as `device_runs.sh engine_core` compares);
- `parity`: the trainer's bf16 weights (TitanEngine) loaded in place into a running
            VLLMEngine; max and mean |generator - trainer| logprob on its samples.

Every part prints its rows and appends them to `--results` (JSON lines); `--table` prints
the table of everything recorded there. Each part stays under ~8 minutes on an H200 (vLLM
starts in ~100 s cold there), so the lead can run one part per device call:

    . /tmp/site.env; . /tmp/site-vllm.env      # DESIGN.md section 7
    for part in plain engine actor hf parity; do   # one device call each
        PYTHONPATH=src:. python bench/vllm_generate_bench.py --part $part --results /tmp/vllm_bench.jsonl
    done
    PYTHONPATH=src:. python bench/vllm_generate_bench.py --table --results /tmp/vllm_bench.jsonl

On CPU, `--tiny` runs every part on a tiny model in a minute or two (a dry run, not a measurement):

    .venv/bin/python bench/vllm_generate_bench.py --tiny --part all
"""

import argparse
import asyncio
import contextlib
import cProfile
import gc
import json
import os
import pstats
import statistics
import tempfile
import time
from pathlib import Path

# Read by vLLM at import and by its engine start-up: in-process engine, nothing fetched.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

import torch  # noqa: E402

from forge.engines.generation import SamplingParams  # noqa: E402
from forge.engines.titan.config import TitanEngineConfig  # noqa: E402
from forge.engines.titan.engine import TitanEngine  # noqa: E402
from forge.engines.vllm import VLLMEngine  # noqa: E402
from forge.engines.vllm_config import VLLMConfig, llm_kwargs  # noqa: E402

PARTS = ("plain", "engine", "actor", "hf", "sampling", "parity")
CONCURRENT_CALLS = 4


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=(*PARTS, "all"), default="all")
    p.add_argument("--tiny", action="store_true", help="tiny model and sizes: a CPU dry run")
    p.add_argument("--flavor", default="0.6B", help="torchtitan qwen3 flavor (random weights)")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--hf-chunk", type=int, default=64, help="prompts per call of the hf engine")
    p.add_argument(
        "--model-dir",
        help="made once, then reused (default: /tmp/forge_vllm_bench_model, or _tiny with --tiny)",
    )
    p.add_argument("--results", default="/tmp/forge_vllm_bench.jsonl")
    p.add_argument(
        "--cprofile",
        action="store_true",
        help="sampling: print where the host's time goes (cProfile), each setting",
    )
    p.add_argument(
        "--only",
        default="",
        help="sampling: the settings whose names contain one of these comma-separated words (all: empty)",
    )
    p.add_argument("--table", action="store_true", help="print the table of --results and exit")
    args = p.parse_args()
    if args.tiny:
        args.flavor, args.prompts, args.n, args.prompt_len, args.max_tokens = "tiny_hd32", 8, 2, 8, 16
        args.dtype, args.hf_chunk = "float32", 4
    tmp = Path(tempfile.gettempdir())
    args.model_dir = args.model_dir or str(
        tmp / ("forge_vllm_bench_tiny" if args.tiny else "forge_vllm_bench_model")
    )
    return args


def record(args, part: str, what: str, value: float, unit: str) -> None:
    row = {"part": part, "what": what, "value": value, "unit": unit, "setting": setting(args)}
    print(f"{part:7s} {what:55s} {value:12,.3f} {unit}", flush=True)
    with open(args.results, "a") as f:
        f.write(json.dumps(row) + "\n")


def setting(args) -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    # VLLM_ENABLE_V1_MULTIPROCESSING=1 from the command line: vLLM's engine core in a process
    # of its own (forge keeps it in the caller's, forge.engines.vllm_config.in_process).
    core = "own process" if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1" else "in process"
    return (
        f"{device}, qwen3 {args.flavor}, {args.dtype}, {args.prompts} prompts x n={args.n}, "
        f"prompt {args.prompt_len}, <= {args.max_tokens} new tokens, engine core {core}"
    )


def print_table(path: str) -> None:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    for s in dict.fromkeys(r["setting"] for r in rows):
        print(f"\n{s}\n\n| part | measurement | value |\n|---|---|---|")
        for r in rows:
            if r["setting"] == s:
                print(f"| {r['part']} | {r['what']} | {r['value']:,.3f} {r['unit']} |")


def titan(args) -> TitanEngine:
    return TitanEngine(
        TitanEngineConfig.model_validate(
            {
                "model": {"flavor": args.flavor},
                "training": {"seq_len": args.prompt_len + args.max_tokens, "seed": 0},
                "parallelism": {},
            }
        ),
        trainable=False,
    )


def model_dir(args) -> Path:
    """A Hugging Face dir with random weights and a word-level tokenizer (token i is `t{i}`)."""
    path = Path(args.model_dir)
    if (path / "config.json").exists():
        return path
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    trainer = titan(args)
    vocab = trainer.model_args.vocab_size
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=f"t{vocab - 1}").save_pretrained(
            tokenizer_dir
        )
        trainer.export_hf(path, tokenizer_dir)
    return path


def prompts(args, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(1, vocab - 1, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)
    ]


def sampling(args) -> SamplingParams:
    return SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=0)


def vllm_config(args) -> VLLMConfig:
    return VLLMConfig(
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_gib=0.05 if args.tiny else None,
        max_model_len=args.prompt_len + args.max_tokens + 8,
    )


def timed(fn):
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def count(samples) -> int:
    return sum(len(s.token_ids) for group in samples for s in group)


def vocab_of(path: Path) -> int:
    return json.loads((path / "config.json").read_text())["vocab_size"]


def part_plain(args, path: Path) -> None:
    from vllm import LLM
    from vllm import SamplingParams as VLLMSamplingParams

    kwargs = llm_kwargs(str(path), vllm_config(args), getattr(torch, args.dtype), torch.cuda.is_available())
    llm, startup = timed(lambda: LLM(**kwargs))
    record(args, "plain", "start-up (LLM(...))", startup, "s")
    batch = [{"prompt_token_ids": p} for p in prompts(args, vocab_of(path))]
    params = VLLMSamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=0, logprobs=0)
    llm.generate(batch, VLLMSamplingParams(n=args.n, max_tokens=8, seed=0), use_tqdm=False)  # warm-up
    outputs, elapsed = timed(lambda: llm.generate(batch, params, use_tqdm=False))
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    record(args, "plain", "LLM.generate, one call, generated tokens/s", tokens / elapsed, "tokens/s")


# name: (per-request seed, logprobs: None, "dicts" (a dict per token) or "flat" (vLLM's
# FlatLogprobs lists), logit bias on the padded vocabulary rows, Python's GC off)
SAMPLING_VARIANTS = {
    "seeded, logprobs, padded rows biased (forge's GRPO default)": (True, "dicts", True, False),
    "unseeded, logprobs": (False, "dicts", False, False),
    "unseeded, no logprobs": (False, None, False, False),
    "unseeded, flat logprobs": (False, "flat", False, False),
    "unseeded, logprobs, GC off": (False, "dicts", False, True),
    "seeded, flat logprobs, padded rows biased": (True, "flat", True, False),
}


def part_sampling(args, path: Path) -> None:
    from vllm import LLM
    from vllm import SamplingParams as VLLMSamplingParams

    llm = LLM(
        **llm_kwargs(str(path), vllm_config(args), getattr(torch, args.dtype), torch.cuda.is_available())
    )
    vocab = vocab_of(path)
    batch = [{"prompt_token_ids": p} for p in prompts(args, vocab)]
    # Qwen3's checkpoints pad 267 rows past the tokenizer's 151,669 tokens.
    padded_rows = {token: float("-inf") for token in range(vocab - min(267, vocab // 4), vocab)}
    llm.generate(batch, VLLMSamplingParams(n=args.n, max_tokens=8), use_tqdm=False)  # warm-up
    only = [word for word in args.only.split(",") if word]
    for name, (seeded, logprobs, biased, gc_off) in SAMPLING_VARIANTS.items():
        if only and not any(word in name for word in only):
            continue
        params = VLLMSamplingParams(
            n=args.n,
            temperature=1.0,
            max_tokens=args.max_tokens,
            seed=0 if seeded else None,
            logprobs=0 if logprobs else None,
            flat_logprobs=logprobs == "flat",
            logit_bias=padded_rows if biased else None,
        )
        runs = []  # twice: a setting's first call may pay for something (a compile) once
        for _ in range(2):
            if gc_off:
                gc.disable()
            with GpuBusy() as busy, host_profile(args.cprofile and runs, name):
                outputs, elapsed = timed(lambda p=params: llm.generate(batch, p, use_tqdm=False))
            gc.enable()
            runs.append((sum(len(c.token_ids) for o in outputs for c in o.outputs) / elapsed, busy.share))
            del outputs
        rate, share = max(runs, key=lambda run: run[0])
        record(args, "sampling", f"{name}: tokens/s (the faster of 2 calls)", rate, "tokens/s")
        if share is not None:
            record(args, "sampling", f"{name}: GPU busy", 100 * share, "%")


@contextlib.contextmanager
def host_profile(on: bool, name: str):
    """With `on`, prints the functions the host spent most of the block's time in."""
    if not on:
        yield
        return
    profile = cProfile.Profile()
    profile.enable()
    yield
    profile.disable()
    print(f"\n--- host time, {name} ---", flush=True)
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


class GpuBusy:
    """The GPU's mean busy share (NVML, every 50 ms) while the block runs; None without NVML."""

    def __enter__(self):
        import threading

        self.share, self._samples, self._stop = None, [], threading.Event()
        try:
            torch.cuda.utilization()
        except Exception:
            return self
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self._samples.append(torch.cuda.utilization() / 100)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._samples:
            self._thread.join()
            self.share = statistics.mean(self._samples)


def part_engine(args, path: Path) -> None:
    engine, startup = timed(lambda: VLLMEngine(str(path), vllm_config(args), dtype=args.dtype))
    record(args, "engine", "start-up (VLLMEngine)", startup, "s")
    batch, params = prompts(args, vocab_of(path)), sampling(args)
    engine.generate(batch, params.model_copy(update={"max_tokens": 8}))  # warm-up
    samples, elapsed = timed(lambda: engine.generate(batch, params))
    record(args, "engine", "generate, one call, generated tokens/s", count(samples) / elapsed, "tokens/s")

    async def concurrent():
        chunk = -(-len(batch) // CONCURRENT_CALLS)
        calls = [engine.generate_async(batch[i : i + chunk], params) for i in range(0, len(batch), chunk)]
        return [group for result in await asyncio.gather(*calls) for group in result.samples]

    samples, elapsed = timed(lambda: asyncio.run(concurrent()))
    record(
        args,
        "engine",
        f"generate_async, {CONCURRENT_CALLS} concurrent calls, tokens/s",
        count(samples) / elapsed,
        "tokens/s",
    )
    weights = {name: torch.randn_like(t) * 0.02 for name, t in engine.hf_state_dict_template().items()}
    seconds = []
    for _ in range(3):
        seconds.append(timed(lambda: engine.load_hf_state_dict(weights))[1])
    record(
        args,
        "engine",
        "in-place weight update (load_hf_state_dict), median of 3",
        statistics.median(seconds),
        "s",
    )
    record(args, "engine", "bytes per weight update", sum(t.nbytes for t in weights.values()) / 1e6, "MB")
    engine.close()


async def _actor(args, path: Path, engine: str) -> None:
    from forge import store
    from forge.actors.generator import Generator, GeneratorConfig
    from forge.controller import shutdown

    gpu = torch.cuda.is_available()
    ids = prompts(args, vocab_of(path))  # the generator samples from ids, as the rollouts send them
    cfg = GeneratorConfig(
        model_path=str(path),
        engine=engine,
        dtype=args.dtype,
        vllm=vllm_config(args),
        sampling=sampling(args),
    )
    await store.initialize()
    try:
        started = time.perf_counter()
        generator = await Generator.options(with_gpus=gpu).as_actor(cfg)
        record(
            args, engine, f"start-up (Generator actor, engine={engine})", time.perf_counter() - started, "s"
        )
        await generator.generate.route(ids, max_tokens=8)  # warm-up
        chunk = args.hf_chunk if engine == "hf" else -(-len(ids) // CONCURRENT_CALLS)
        started = time.perf_counter()
        results = await asyncio.gather(
            *(generator.generate.route(ids[i : i + chunk]) for i in range(0, len(ids), chunk))
        )
        elapsed = time.perf_counter() - started
        tokens = sum(c.response_len for result in results for group in result for c in group)
        record(
            args,
            engine,
            f"Generator.generate, {len(results)} concurrent calls, tokens/s",
            tokens / elapsed,
            "tokens/s",
        )
        if engine == "vllm":
            trainer_weights = {n: t * 1.01 for n, t in titan_weights(args, path).items()}
            await store.put_state_dict(1, trainer_weights)
            started = time.perf_counter()
            await generator.update_weights.route(1)
            record(
                args,
                engine,
                "Generator.update_weights from the store (wall)",
                time.perf_counter() - started,
                "s",
            )
    finally:
        await store.shutdown()
        await shutdown()


def titan_weights(args, path: Path) -> dict[str, torch.Tensor]:
    """The trainer's weights under HF names, in the generator's dtype, on CPU."""
    trainer = titan(args)
    return {
        n: t.detach().to("cpu", getattr(torch, args.dtype)).clone()
        for n, t in trainer.hf_state_dict().items()
    }


def part_parity(args, path: Path) -> None:
    from forge.rl.ops import compute_logprobs

    engine = VLLMEngine(str(path), vllm_config(args), dtype=args.dtype)
    # The trainer keeps float32 master weights; seed 1 makes them differ from the start-up dir.
    trainer = TitanEngine(
        TitanEngineConfig.model_validate(
            {
                "model": {"flavor": args.flavor},
                "training": {"seq_len": args.prompt_len + args.max_tokens, "seed": 1},
                "parallelism": {},
            }
        ),
        trainable=False,
    )
    weights = {
        n: t.detach().to("cpu", getattr(torch, args.dtype)).clone()
        for n, t in trainer.hf_state_dict().items()
    }
    engine.load_hf_state_dict(weights)
    batch = prompts(args, vocab_of(path))[:16]
    samples = engine.generate(batch, sampling(args).model_copy(update={"n": 2}))
    gaps = []
    for prompt, group in zip(batch, samples, strict=True):
        for s in group:
            tokens = torch.tensor([prompt + s.token_ids])
            with torch.no_grad():
                logits = trainer.forward(tokens[:, :-1]).float()
            ours = compute_logprobs(logits, tokens[:, 1:].to(logits.device))[0, len(prompt) - 1 :].cpu()
            gaps.append((ours - torch.tensor(s.logprobs)).abs())
    gap = torch.cat(gaps)
    record(args, "parity", "max |generator - trainer| logprob after load", float(gap.max()), "nats")
    record(args, "parity", "mean |generator - trainer| logprob after load", float(gap.mean()), "nats")
    engine.close()


def main() -> None:
    args = parse_args()
    if args.table:
        print_table(args.results)
        return
    path = model_dir(args)
    for part in PARTS if args.part == "all" else (args.part,):
        if part == "plain":
            part_plain(args, path)
        elif part == "engine":
            part_engine(args, path)
        elif part == "sampling":
            part_sampling(args, path)
        elif part in ("actor", "hf"):
            asyncio.run(_actor(args, path, "vllm" if part == "actor" else "hf"))
        else:
            part_parity(args, path)
    print_table(args.results)


if __name__ == "__main__":
    main()
