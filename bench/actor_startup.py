"""What an app run's processes cost in CPU, and how much of it is imports.

Runs the GRPO app (`python -m apps.grpo.main`, the embedded CPU demo by default) for a few steps,
samples every process it starts (CPU seconds from /proc, named by their actor mesh), and then
imports each actor's modules in fresh processes. Prints two tables: each process of the run, and
the CPU a fresh process spends importing what each kind of actor needs before its first call.

    PYTHONPATH=src:. python bench/actor_startup.py [--config configs/grpo/tiny_cpu.yaml] [--steps 2]

Why: the test suite starts about 300 actor processes, which take three quarters of its CPU
(README, `make test`); a run's restart (`max_restarts`) starts every actor again. The first
table says which processes a run's start-up costs; the second, how much of that a process that
did not import everything again would save.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

# What each kind of actor's process imports before its first call: its actor module and the
# engine its setup loads (the CPU demo's: the TorchTitan trainer, the transformers generator).
ACTOR_IMPORTS = {
    "TitanTrainer": ["forge.actors.trainer", "forge.engines.titan.engine"],
    "Generator (hf)": ["forge.actors.generator", "forge.engines.hf_generate"],
    "ReplayBuffer": ["forge.actors.replay_buffer"],
    "ComputeAdvantages": ["forge.actors.advantages"],
    "TorchStore volume": ["forge.store"],
    "RewardActor": ["forge.actors.reward"],
    "DatasetActor": ["forge.actors.dataset"],
    "(a bare Monarch process)": ["monarch.actor"],
}


def process_name(process: psutil.Process) -> str:
    """An actor's process by its mesh (Monarch's HYPERACTOR_PROCESS_NAME); a process an actor
    started (a reward worker, a tracker) by its mesh and command; the app by its module."""
    command = process.cmdline()
    mesh = process.environ().get("HYPERACTOR_PROCESS_NAME", "").split(" @ ")[0]
    if mesh and "monarch._src.actor.bootstrap_main" in command:
        return mesh
    if "apps.grpo.main" in command:
        return "the app (controller)"
    program = " ".join(part.rsplit("/", 1)[-1] for part in command[:4])
    return f"{mesh}: {program}" if mesh else program


def run_app(config: str, steps: int) -> tuple[list[tuple[str, int, float, float]], float]:
    """The app's processes as (name, pid, CPU s, seconds alive), and the run's wall seconds."""
    seen: dict[int, list] = {}  # pid -> [name, CPU s, first seen, last seen]
    with tempfile.TemporaryDirectory(prefix="actor_startup_") as output_dir:
        log_path = Path(output_dir) / "app.log"
        argv = [sys.executable, "-m", "apps.grpo.main", "--config", config, f"max_steps={steps}"]
        start = time.monotonic()
        with log_path.open("w") as log:
            app = subprocess.Popen([*argv, f"output_dir={output_dir}"], stdout=log, stderr=subprocess.STDOUT)
            root = psutil.Process(app.pid)
            while app.poll() is None:
                now = time.monotonic() - start
                for process in [root, *root.children(recursive=True)]:
                    try:
                        # Named again at every sample: one seen between its fork and its exec
                        # still shows its parent's command.
                        name, cpu = process_name(process), sum(process.cpu_times()[:2])
                    except psutil.Error:
                        continue  # ended since the listing
                    record = seen.setdefault(process.pid, [name, cpu, now, now])
                    record[0], record[1], record[3] = name, cpu, now
                time.sleep(0.1)
        wall = time.monotonic() - start
        if app.returncode != 0:
            raise SystemExit(f"the app failed (exit {app.returncode}):\n{log_path.read_text()[-3000:]}")
    rows = [(name, pid, cpu, last - first) for pid, (name, cpu, first, last) in seen.items()]
    return sorted(rows, key=lambda row: -row[2]), wall


def import_cpu(modules: list[str], rounds: int) -> float:
    """Median CPU seconds (user + system) of a fresh interpreter importing `modules`."""
    samples = []
    for _ in range(rounds):
        before = os.times()
        subprocess.run([sys.executable, "-c", f"import {', '.join(modules)}"], check=True)
        after = os.times()
        samples.append(
            after.children_user - before.children_user + after.children_system - before.children_system
        )
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/grpo/tiny_cpu.yaml")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="fresh imports per actor kind")
    args = parser.parse_args()

    rows, wall = run_app(args.config, args.steps)
    print(f"\n{args.config}, {args.steps} steps: {wall:.1f} s, {len(rows)} processes\n")
    print("| process | pid | CPU s | alive s |\n|---|---:|---:|---:|")
    for name, pid, cpu, alive in rows:
        print(f"| {name} | {pid} | {cpu:.2f} | {alive:.1f} |")
    print(f"| all | | {sum(row[2] for row in rows):.2f} | |")

    print(f"\nImports in a fresh process (median of {args.rounds}):\n")
    print("| actor | modules | CPU s |\n|---|---|---:|")
    for actor, modules in ACTOR_IMPORTS.items():
        print(f"| {actor} | {', '.join(modules)} | {import_cpu(modules, args.rounds):.2f} |")


if __name__ == "__main__":
    main()
