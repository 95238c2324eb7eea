"""How long vLLM takes to load a new weight version on one GPU, idle and beside a busy trainer.

    PYTHONPATH=src:. python bench/vllm_weight_load.py --out DIR [--sizes 0.6B 1.7B] [--loads 8]

For each size (torchtitan's Qwen3 flavor with random bf16 weights, exported as in
bench/gpu_throughput.py), one process starts the vLLM engine and loads versions from receive
buffers on the GPU (what the generator holds after a CUDA IPC pull), two ways:
- `load_weights`: the model's own loader, tensor by tensor (the path before the copy plan);
- `replay`: the engine's path, the loader's copies recorded at the first load, checked against
  the loader at the second, replayed after (`forge.engines.copy_plan`).
Each is timed to the end of its GPU work (a device synchronize), first on an idle GPU, then
while another process keeps the GPU busy with bf16 matmuls (as the trainer does when every
actor shares it). The exactness check replays a new version, then runs the loader on the same
version and compares every parameter bit for bit. Prints one table row per size and path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HOG = """
import sys, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
print("busy", flush=True)
while True:
    for _ in range(50):
        c = a @ b
    torch.cuda.synchronize()
"""


def timed(fn) -> float:
    import torch

    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3


def measure(size: str, out: Path, loads: int) -> dict:
    import torch
    from bench.gpu_throughput import export_random_policy

    from forge.engines.vllm import VLLMEngine
    from forge.engines.vllm_config import VLLMConfig

    policy = export_random_policy(size, out / size)
    engine = VLLMEngine(str(policy), VLLMConfig(kv_cache_memory_gib=4, max_model_len=512), dtype="bfloat16")
    buffers = engine.hf_state_dict_template()
    weights = engine._layout.named_tensors(buffers)
    loader = engine._load  # the engine's ReplayedLoader (one GPU)
    version = iter(range(1, 10_000))

    def fill() -> None:
        torch.manual_seed(next(version))
        for t in buffers.values():
            t.normal_(0, 0.02)

    def engine_load() -> None:
        engine.load_hf_state_dict(buffers)

    result = {"size": size, "nbytes": sum(t.numel() * t.element_size() for t in buffers.values())}
    fill()
    result["record_ms"] = timed(engine_load)
    fill()
    result["check_ms"] = timed(engine_load)
    result["plan_copies"] = len(loader.plan.copies) if loader.plan else 0
    result["checked"] = loader.checked
    hog = None
    for phase in ("idle", "busy"):
        if phase == "busy":
            hog = subprocess.Popen([sys.executable, "-c", HOG], stdout=subprocess.PIPE, text=True)
            hog.stdout.readline()
            time.sleep(2)
        for path, load in (("replay", engine_load), ("load_weights", lambda: loader._load(weights))):
            times = []
            for _ in range(loads):
                fill()
                times.append(timed(load))
            result[f"{path}_{phase}_ms"] = statistics.median(times)
    hog.kill()

    fill()
    engine.load_hf_state_dict(buffers)  # a replay
    replayed = {n: p.detach().clone() for n, p in loader._targets().items()}
    loader._load(weights)
    result["replay_equals_loader"] = all(torch.equal(p, replayed[n]) for n, p in loader._targets().items())
    result["bytes_compared"] = sum(t.numel() * t.element_size() for t in replayed.values())
    engine.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sizes", nargs="+", default=["0.6B", "1.7B"])
    parser.add_argument("--loads", type=int, default=8)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a size, measured in this process
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(args.one, args.out, args.loads)), flush=True)
        return
    rows = []
    for size in args.sizes:  # one process each: vLLM's memory is freed with it
        command = [
            sys.executable,
            __file__,
            "--out",
            str(args.out),
            "--loads",
            str(args.loads),
            "--one",
            size,
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not found:
            sys.stderr.write(done.stderr[-4000:])
            raise SystemExit(f"{size}: the measuring process failed ({done.returncode})")
        rows.append(json.loads(found[0].removeprefix("RESULT ")))
    (args.out / "weight_load.json").write_text(json.dumps(rows, indent=1))
    print("| size | GB | path | idle ms | beside a busy GPU ms |")
    print("|---|---:|---|---:|---:|")
    for r in rows:
        for path in ("load_weights", "replay"):
            gb = r["nbytes"] / 1e9
            print(
                f"| {r['size']} | {gb:.2f} | {path} | {r[f'{path}_idle_ms']:.1f} | {r[f'{path}_busy_ms']:.1f} |"
            )
    for r in rows:
        print(
            f"{r['size']}: first load (recording) {r['record_ms']:.0f} ms, second (checked against the "
            f"loader: {r['checked']}) {r['check_ms']:.0f} ms, {r['plan_copies']} copies; a replay equals "
            f"the loader on {r['bytes_compared'] / 1e9:.2f} GB: {r['replay_equals_loader']}"
        )


if __name__ == "__main__":
    main()
