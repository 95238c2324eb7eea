"""The tool demo against the same model without the tool, on the same task, from scratch.

    .venv/bin/python bench/tool_demo.py [--root runs/bench_tool_demo] [--steps 60]

Both arms train the embedded tiny model on sums of three 2-3 digit numbers, with the same SFT
budget (configs/sft/tool_cpu.yaml's steps) and the same GRPO budget (configs/grpo/tool_cpu.yaml):
- tool: SFT on calculator demonstrations (multi-turn), then GRPO with the calculator environment;
- no tool: SFT on the answers alone, then GRPO on one-turn answers (env=null).
Prints held-out success (greedy, 200 problems) by GRPO step, with the seconds of GRPO (from the
initial eval's metrics row, so start-up and the SFT are not counted) and the whole command's time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

SFT = "configs/sft/tool_cpu.yaml"
GRPO = "configs/grpo/tool_cpu.yaml"
# One-turn answers: no environment, no stop string, and room for the answer alone.
NO_TOOL = [
    "env=null",
    "dataset.toy_task.answer_format=plain",
    "generator.sampling.stop=[]",
    "generator.sampling.max_tokens=6",
    "eval.max_tokens=6",
    "trainer.engine.training.seq_len=32",
]


def run(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", *command], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def arm(root: Path, name: str, steps: int, sft_overrides: list[str], grpo_overrides: list[str]) -> dict:
    sft_dir, grpo_dir = root / f"sft_{name}", root / f"grpo_{name}"
    sft_s = run(["apps.sft.main", "--config", SFT, f"run_dir={sft_dir}", *sft_overrides])
    grpo_s = run(
        [
            "apps.grpo.main",
            "--config",
            GRPO,
            f"policy_path={sft_dir}/export",
            f"output_dir={grpo_dir}",
            "warm_start.sft_config=null",
            f"max_steps={steps}",
            *grpo_overrides,
        ]
    )
    rows = [json.loads(line) for line in (grpo_dir / "metrics.jsonl").read_text().splitlines()]
    start = rows[0]["time"]
    evals = {r["step"]: (r["eval/accuracy"], r["time"] - start) for r in rows if "eval/accuracy" in r}
    return {"sft_s": sft_s, "grpo_s": grpo_s, "evals": evals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path("runs/bench_tool_demo"))
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    if args.root.exists():
        parser.exit(2, f"{args.root} exists: give a fresh --root, the arms start from scratch\n")
    tool = arm(args.root, "tool", args.steps, [], [])
    plain = arm(args.root, "no_tool", args.steps, ["data.embedded_task.answer_format=plain"], NO_TOOL)
    print("| GRPO step | tool: success | tool: s of GRPO | no tool: success | no tool: s of GRPO |")
    print("|---:|---:|---:|---:|---:|")
    for step in sorted(tool["evals"]):
        (acc, secs), (plain_acc, plain_secs) = (
            tool["evals"][step],
            plain["evals"].get(step, (float("nan"),) * 2),
        )
        print(f"| {step} | {acc:.3f} | {secs:.0f} | {plain_acc:.3f} | {plain_secs:.0f} |")
    for name, result in (("tool", tool), ("no tool", plain)):
        print(f"{name}: SFT command {result['sft_s']:.0f} s, GRPO command {result['grpo_s']:.0f} s")


if __name__ == "__main__":
    main()
