"""The tool demo against the same model without the tool, on the same task, from scratch.

    .venv/bin/python bench/tool_demo.py [--root runs/bench_tool_demo] [--steps 60] [--arms tool,no_tool]

Every arm trains the embedded tiny model on sums of three 2-3 digit numbers, with the same SFT
budget (configs/sft/tool_cpu.yaml's steps) and the same GRPO budget (configs/grpo/tool_cpu.yaml):
- tool: SFT on calculator demonstrations (multi-turn), then GRPO with the calculator environment;
- agent: the same SFT, then GRPO of the calculator loop written as an agent program against the
  OpenAI API (configs/grpo/agent_cpu.yaml, examples/calc_agent/agent.py);
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
AGENT = "configs/grpo/agent_cpu.yaml"
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


def arm(
    root: Path, name: str, steps: int, sft_overrides: list[str], grpo_overrides: list[str], grpo: str = GRPO
) -> dict:
    sft_dir, grpo_dir = root / f"sft_{name}", root / f"grpo_{name}"
    sft_s = run(["apps.sft.main", "--config", SFT, f"run_dir={sft_dir}", *sft_overrides])
    grpo_s = run(
        [
            "apps.grpo.main",
            "--config",
            grpo,
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


ARMS = {
    "tool": ([], [], GRPO),
    "agent": ([], [], AGENT),
    "no_tool": (["data.embedded_task.answer_format=plain"], NO_TOOL, GRPO),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path("runs/bench_tool_demo"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--arms", type=lambda text: text.split(","), default=["tool", "no_tool"])
    args = parser.parse_args()
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arms {unknown}: choose from {list(ARMS)}")
    if args.root.exists():
        parser.exit(2, f"{args.root} exists: give a fresh --root, the arms start from scratch\n")
    results = {name: arm(args.root, name, args.steps, *ARMS[name]) for name in args.arms}
    print("| GRPO step | " + " | ".join(f"{name}: success | {name}: s of GRPO" for name in results) + " |")
    print("|---:|" + "---:|---:|" * len(results))
    first = results[args.arms[0]]["evals"]
    for step in sorted(first):
        cells = []
        for result in results.values():
            accuracy, seconds = result["evals"].get(step, (float("nan"),) * 2)
            cells.append(f"{accuracy:.3f} | {seconds:.0f}")
        print(f"| {step} | " + " | ".join(cells) + " |")
    for name, result in results.items():
        print(f"{name}: SFT command {result['sft_s']:.0f} s, GRPO command {result['grpo_s']:.0f} s")


if __name__ == "__main__":
    main()
