"""GRPO throughput at real model sizes: the whole app (every actor, the real weight sync) for a
few steps on Qwen3-shaped models with random weights (no checkpoint can be downloaded on the GPU
machines), with GPU utilization and memory sampled by nvidia-smi. Prints one table row per size.

    PYTHONPATH=src:. python bench/gpu_throughput.py --out DIR [--sizes 0.6B 1.7B] [--steps 8]
        [--engine hf|vllm] [override ...]

The policy is torchtitan's flavor at its real vocabulary (151,936), exported to DIR with the
embedded character tokenizer: a random model mostly samples ids the tokenizer cannot print, so
every completion runs to `max_tokens` and scores 0 (groups are kept anyway); speed, not
learning, is measured. By default every actor shares GPU 0 (`provisioner.colocate=true`);
`provisioner.colocate=false` gives trainer and generator a GPU each. Times are means over the
steps after the first; trainer tokens/s is the step's trained tokens over the step time less
the waits for a batch and for the weight sync.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

STEP_TIME_KEYS = ("grpo/step_s", "grpo/wait_batch_ms", "grpo/weight_sync_ms")


def export_random_policy(size: str, out: Path) -> Path:
    """torchtitan's `size` flavor, randomly initialised, as a Hugging Face directory in bf16."""
    from forge.data.tokenizer import embedded_tokenizer
    from forge.engines.titan.config import TitanEngineConfig
    from forge.engines.titan.engine import TitanEngine

    tokenizer_dir = out / "tokenizer"
    embedded_tokenizer().save_pretrained(tokenizer_dir)
    config = {"model": {"flavor": size}, "training": {"seq_len": 512, "dtype": "bfloat16"}}
    engine = TitanEngine(TitanEngineConfig.model_validate(config), trainable=False)
    return engine.export_hf(out / "policy", tokenizer_dir)


def config_lines(policy: Path, out: Path, size: str, engine: str, steps: int) -> list[str]:
    return [
        f"policy_path={policy}",
        f"output_dir={out}",
        f"max_steps={steps}",
        "dataset.source=toy_task",
        "dataset.path=null",
        "generator.dtype=bfloat16",
        f"generator.engine={engine}",
        "generator.sampling.max_tokens=128",
        "generator.sampling.temperature=1.0",
        f"trainer.engine.model.flavor={size}",
        "trainer.engine.training.seq_len=256",
        "trainer.engine.training.mixed_precision_param=bfloat16",
        "trainer.engine.training.microbatch_size=16",
        "trainer.engine.optimizer.lr=1e-6",
        "trainer.loss.params.temperature=1.0",
        "rollout.prompts_per_step=16",
        "rollout.group_size=8",
        "rollout.skip_groups_without_signal=false",
        "replay_buffer.batch_size=128",
        "replay_buffer.max_policy_age=1",
        "eval.every=0",
        "provisioner.colocate=true",
        "metrics.rollouts_path=null",
        "metrics.tensorboard_dir=null",
        "checkpoint.every=0",
    ]


def summarize(size: str, engine: str, rows: list[dict], gpu: dict) -> dict:
    timed = [r for r in rows if r["step"] >= 2] or rows

    def mean(key: str) -> float:
        values = [r[key] for r in timed if key in r]
        return statistics.mean(values) if values else float("nan")

    train_s = [
        r["grpo/step_s"] - (r["grpo/wait_batch_ms"] + r["grpo/weight_sync_ms"]) / 1e3
        for r in timed
        if all(k in r for k in STEP_TIME_KEYS)
    ]
    trained_tokens = mean("train/tokens")
    added = sum(r.get("buffer/added", 0) for r in rows)
    evicted = sum(r.get("buffer/evicted_stale", 0) for r in rows)
    return {
        "size": size,
        "engine": engine,
        "s/step": mean("grpo/step_s"),
        "gen tok/s": mean("generator/tokens_per_s"),
        "trainer tok/s": trained_tokens / statistics.mean(train_s) if train_s else float("nan"),
        "pull ms": mean("weight_sync/pull_s") * 1e3,
        "publish ms": mean("weight_sync/publish_s") * 1e3,
        "loop sync wait ms": mean("grpo/weight_sync_ms"),
        "stale evicted": evicted / added if added else 0.0,
        **gpu,
    }


def gpu_samples(path: Path) -> dict:
    """Mean utilization and peak memory per GPU from nvidia-smi's CSV (index, util %, MiB)."""
    per_gpu: dict[str, list[tuple[float, float]]] = {}
    for line in path.read_text().splitlines():
        index, util, mem = (field.strip() for field in line.split(","))
        per_gpu.setdefault(index, []).append((float(util), float(mem)))
    busy = {i: [s for s in samples if s[1] > 0] or samples for i, samples in per_gpu.items()}
    return {
        "GPU util %": " / ".join(f"{statistics.mean(u for u, _ in s):.0f}" for s in busy.values()),
        "GPU mem GiB": " / ".join(f"{max(m for _, m in s) / 1024:.1f}" for s in busy.values()),
    }


def run(size: str, engine: str, steps: int, out: Path, overrides: list[str]) -> dict:
    root = out / size
    policy = root / "policy"
    if not (policy / "config.json").exists():  # in a child: the export's process group stays there
        subprocess.run([sys.executable, __file__, "--export", size, str(root)], check=True)
    smi_path = root / "gpu.csv"
    query = ["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used", "--format=csv,noheader,nounits"]
    run_dir = root / f"run_{engine}"
    command = [sys.executable, "-m", "apps.grpo.main", "--config", "configs/grpo/qwen3_1_7b.yaml"]
    command += config_lines(policy, run_dir, size, engine, steps) + overrides
    with smi_path.open("w") as smi_out:
        sampler = (
            subprocess.Popen([*query, "-lms", "500"], stdout=smi_out) if shutil.which("nvidia-smi") else None
        )
        try:
            subprocess.run(command, check=True)
        finally:
            if sampler is not None:
                sampler.terminate()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    gpu = gpu_samples(smi_path) if sampler is not None else {}
    return summarize(size, engine, [r for r in rows if r["step"] >= 1], gpu)


def print_table(results: list[dict]) -> None:
    columns = list(results[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in results:
        cells = [
            f"{v:,.3f}"
            if isinstance(v, float) and v < 10
            else f"{v:,.0f}"
            if isinstance(v, float)
            else str(v)
            for v in row.values()
        ]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sizes", nargs="+", default=["0.6B", "1.7B"])
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--steps", type=int, default=8)
    args, overrides = parser.parse_known_args()
    results = []
    for size in args.sizes:
        results.append(run(size, args.engine, args.steps, args.out, overrides))
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        print_table(results)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--export"]:  # the child that `run` starts: --export SIZE DIR
        export_random_policy(sys.argv[2], Path(sys.argv[3]))
    else:
        main()
