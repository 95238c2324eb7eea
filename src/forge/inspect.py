"""Read a run's recorded completions as a table.

    python -m forge.inspect RUN_DIR [--step N] [--worst K] [--best K] [--eval] [--limit L] [--turns]

Without --worst/--best it shows the records of one step (the latest, or --step N), up to
--limit rows. --worst K / --best K pick the K lowest / highest rewards (of that step with
--step, of the whole run without). --eval shows the greedy eval answers instead of the
training episodes. --turns shows each multi-turn trajectory turn by turn: who wrote each part,
its tokens, whether they were trained (the model's) or only read (the environment's), and the
reward the environment gave for each model turn.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from forge.observability.run_dir import run_file
from forge.rollout.records import read_records

COLUMNS = (("step", 5), ("ver", 4), ("reward", 7), ("adv", 7), ("len", 4), ("turns", 5), ("stop", 6))


def _clip(text: str, width: int) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 1] + "…"


def _number(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def select(
    records: list[dict],
    *,
    step: int | None = None,
    worst: int | None = None,
    best: int | None = None,
    limit: int = 20,
) -> list[dict]:
    """The records the table shows, in display order."""
    if step is not None:
        records = [r for r in records if r["step"] == step]
    elif worst is None and best is None and records:
        latest = max(r["step"] for r in records)
        records = [r for r in records if r["step"] == latest]
    by_reward = sorted(records, key=lambda r: r["reward"])
    if worst is not None or best is not None:
        picked = by_reward[:worst] if worst else []
        return picked + (by_reward[::-1][:best] if best else [])
    return records[:limit]


def format_table(records: list[dict], prompt_width: int = 30, completion_width: int = 40) -> str:
    header = [name.rjust(width) for name, width in COLUMNS]
    header += ["prompt".ljust(prompt_width), "target".ljust(10), "completion"]
    lines = [" ".join(header).rstrip()]
    for r in records:
        cells = [
            str(r["step"]).rjust(5),
            str(r["policy_version"]).rjust(4),
            _number(r["reward"]).rjust(7),
            _number(r.get("advantage")).rjust(7),
            str(r["response_len"]).rjust(4),
            _turns_cell(r).rjust(5),
            str(r["stop_reason"]).rjust(6),
            _clip(r["prompt"], prompt_width).ljust(prompt_width),
            _clip(str(r.get("target", "")), 10).ljust(10),
            _clip(r["completion"], completion_width),
        ]
        lines.append(" ".join(cells).rstrip())
    return "\n".join(lines)


def _turns_cell(record: dict) -> str:
    """Model turns, with a ``+`` when a limit cut the trajectory ("1" for a one-turn record)."""
    turns = record.get("turns")
    if turns is None:
        return "1"
    model_turns = sum(t["role"] == "assistant" for t in turns)
    return f"{model_turns}{'+' if record.get('truncated') else ''}"


def format_turns(record: dict, width: int = 70) -> str:
    """One record, turn by turn (a one-turn record is one assistant turn)."""
    head = (
        f"step {record['step']} | version {record['policy_version']} | reward {_number(record['reward'])}"
        f" | advantage {_number(record.get('advantage'))} | target {record.get('target', '')!r}"
    )
    if record.get("truncated"):
        head += " | truncated"
    breakdown = record.get("reward_breakdown")
    if breakdown:
        head += " | " + ", ".join(f"{name} {value:.3f}" for name, value in breakdown.items())
    turns = record.get("turns") or [
        {
            "role": "assistant",
            "text": record["completion"],
            "num_tokens": record["response_len"],
            "reward": 0.0,
        }
    ]
    lines = [head, f"  {'prompt':>9} | {_clip(record['prompt'], width)}"]
    for turn in turns:
        # What the trainer does with the turn's tokens (an eval answer is sampled, never trained).
        sampled = "sampled" if record["eval"] else "trained"
        trained = sampled if turn["role"] == "assistant" else "read only"
        note = f"{turn['num_tokens']} tokens, {trained}"
        if turn["role"] == "assistant" and turn["reward"]:
            note += f", env reward {turn['reward']:.3f}"
        lines.append(f"  {turn['role']:>9} | {_clip(turn['text'], width).ljust(width)}  ({note})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m forge.inspect", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run's output_dir")
    parser.add_argument("--step", type=int, help="only this training step")
    parser.add_argument("--worst", type=int, metavar="K", help="the K lowest rewards")
    parser.add_argument("--best", type=int, metavar="K", help="the K highest rewards")
    parser.add_argument(
        "--eval", action="store_true", help="greedy eval answers instead of training episodes"
    )
    parser.add_argument("--limit", type=int, default=20, help="rows shown without --worst/--best")
    parser.add_argument("--width", type=int, default=40, help="characters of each completion shown")
    parser.add_argument(
        "--turns", action="store_true", help="each record turn by turn (who wrote what, what was trained)"
    )
    args = parser.parse_args(argv)
    try:
        path = run_file(args.run_dir, "rollouts_path")
        records = [r for r in read_records(path) if r["eval"] == args.eval]
    except (FileNotFoundError, ValueError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    kind = "eval answers" if args.eval else "training episodes"
    if not records:
        parser.exit(1, f"{path} records no {kind}\n")
    steps = sorted({r["step"] for r in records})
    shown = select(records, step=args.step, worst=args.worst, best=args.best, limit=args.limit)
    body = (
        "\n\n".join(format_turns(r, max(args.width, 20)) for r in shown)
        if args.turns
        else format_table(shown, completion_width=args.width)
    )
    sys.stdout.write(
        f"{path}: {len(records)} {kind}, steps {steps[0]}..{steps[-1]}; showing {len(shown)}\n{body}\n"
    )


if __name__ == "__main__":
    main()
