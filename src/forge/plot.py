"""Plot a run's metrics as PNG figures under RUN_DIR/plots/.

    python -m forge.plot RUN_DIR

- reward.png: rollout reward and eval accuracy, against step and against wall time;
- loss.png: loss terms, clip fractions, mismatch KL between generator and trainer;
- system.png: policy age of trained episodes, weight-sync time, generated tokens/s.

A panel whose metrics the run did not record says so instead of being left out, so the
figures of two runs always line up. Needs matplotlib (`pip install forge[plot]`).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from forge.observability.run_dir import read_metric_rows, run_file

# figure -> panels; a panel is (title, y label, metric keys, x axis: "step" or "wall").
FIGURES: dict[str, list[tuple[str, str, tuple[str, ...], str]]] = {
    "reward": [
        ("reward and accuracy vs step", "", ("rollout/reward", "eval/accuracy"), "step"),
        ("reward and accuracy vs wall time", "", ("rollout/reward", "eval/accuracy"), "wall"),
    ],
    "loss": [
        ("loss terms", "", ("train/loss", "loss/pg", "loss/kl", "loss/entropy"), "step"),
        ("clip fractions", "fraction of tokens", ("loss/clip_frac_low", "loss/clip_frac_high"), "step"),
        ("generator/trainer mismatch", "KL (k3)", ("loss/mismatch_kl",), "step"),
    ],
    "system": [
        (
            "policy age of trained episodes",
            "versions",
            ("buffer/policy_age_mean", "buffer/policy_age_max"),
            "step",
        ),
        ("weight sync", "ms", ("grpo/weight_sync_ms", "generator/weight_sync_ms"), "step"),
        ("generation speed", "tokens/s", ("generator/tokens_per_s",), "step"),
    ],
}


def _series(rows: list[dict], key: str, x_axis: str) -> tuple[list[float], list[float]]:
    start = rows[0]["time"]
    xs, ys = [], []
    for row in rows:
        value = row.get(key)
        if value is None or not math.isfinite(value):
            continue
        xs.append(row["step"] if x_axis == "step" else (row["time"] - start) / 60)
        ys.append(value)
    return xs, ys


def plot_run(run_dir: str | Path) -> list[Path]:
    """Writes the figures of the run in `run_dir`; returns their paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("python -m forge.plot needs matplotlib: pip install forge[plot]") from e
    run_dir = Path(run_dir)
    rows = read_metric_rows(run_file(run_dir, "jsonl_path"))
    if not rows:
        raise ValueError(f"the metrics file of {run_dir} has no rows yet")
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    written = []
    for name, panels in FIGURES.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
        for ax, (title, ylabel, keys, x_axis) in zip(axes[0], panels, strict=True):
            plotted = False
            for key in keys:
                xs, ys = _series(rows, key, x_axis)
                if xs:
                    # Evals are sparse: mark the points so that a single one is visible.
                    ax.plot(xs, ys, label=key, marker="o" if len(xs) < 30 else None, markersize=3)
                    plotted = True
            if plotted:
                ax.legend(fontsize=8)
            else:
                ax.text(
                    0.5, 0.5, "not recorded in this run", ha="center", va="center", transform=ax.transAxes
                )
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("step" if x_axis == "step" else "wall time (min)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        fig.suptitle(f"{run_dir.name}: {name}", fontsize=11)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(prog="python -m forge.plot", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run's output_dir")
    args = parser.parse_args(argv)
    try:
        written = plot_run(args.run_dir)
    except (FileNotFoundError, ValueError, ImportError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
