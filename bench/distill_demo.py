"""On-policy distillation on CPU: the embedded task's GRPO-trained model teaches the SFT warm start
with no reward function, against GRPO from the same start. Prints a table.

    PYTHONPATH=. .venv/bin/python bench/distill_demo.py [--teacher-steps 400] [--steps 400] [key=value ...]

1. The warm start: configs/sft/tiny_cpu.yaml's export (trained first when missing, as `make grpo`).
2. The teacher: GRPO from the warm start with configs/grpo/tiny_cpu.yaml for --teacher-steps
   steps, exported (kept and reused from OUTPUT/teacher when there). Its held-out accuracy curve
   is GRPO's side of the comparison.
3. The student: the warm start again, distilled from the teacher (`distill.teacher_path`) with
   `reward.functions: []`: the teacher's per-token logprobs are the only signal. The same
   settings otherwise (the demo's learning rate, batch, sampling temperature).

Both run the actor app. For each, the table gives the held-out greedy accuracy at each eval and
the first eval step within --within of the teacher's final accuracy, with the seconds of train
steps up to it (the sum of `grpo/step_s`: start-up and the warm start not counted). The
`key=value` overrides go to both runs (e.g. `eval.every=10`).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from apps.grpo.main import main as run_app

from app_runs import curve, read_rows

CONFIG = "configs/grpo/tiny_cpu.yaml"


def reached(points: list[tuple[int, float, float]], target: float) -> tuple[int, float] | None:
    """The first eval at or above `target`: (step, seconds)."""
    return next(((step, s) for step, accuracy, s in points if accuracy >= target), None)


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher-steps", type=int, default=400)
    parser.add_argument("--steps", type=int, default=400, help="distillation steps")
    parser.add_argument("--weight", type=float, default=1.0, help="distill.weight")
    parser.add_argument("--within", type=float, default=0.05, help="of the teacher's final accuracy")
    parser.add_argument("--output", default="runs/distill_demo")
    args, overrides = parser.parse_known_args()
    out = Path(args.output)

    teacher_dir = out / "teacher"
    if not (teacher_dir / "export" / "config.json").is_file():
        run_app(
            ["--config", CONFIG, f"output_dir={teacher_dir}", f"max_steps={args.teacher_steps}", *overrides]
        )
    teacher = curve(read_rows(teacher_dir))
    teacher_accuracy = teacher[-1][1]

    student_dir = out / f"student_{args.steps}_w{args.weight:g}"
    run_app(
        [
            "--config",
            CONFIG,
            f"output_dir={student_dir}",
            f"max_steps={args.steps}",
            f"distill.teacher_path={(teacher_dir / 'export').resolve()}",
            f"distill.weight={args.weight}",
            "reward.functions=[]",
            # No reward: every group's rewards are equal, and the teacher's signal is in all of them.
            "rollout.skip_groups_without_signal=false",
            *overrides,
        ]
    )
    student = curve(read_rows(student_dir))

    target = teacher_accuracy - args.within
    print(
        f"\nteacher: GRPO from the warm start, {teacher[-1][0]} steps, held-out accuracy {teacher_accuracy:.3f}; "
        f"target (within {args.within}): {target:.3f}"
    )
    print("| run | start acc | final acc | step reaching target | train seconds to it |")
    print("|---|---:|---:|---:|---:|")
    for name, points in (
        ("GRPO (teacher's run)", teacher),
        (f"distill, no reward, weight {args.weight:g}", student),
    ):
        hit = reached(points, target)
        step, seconds = (str(hit[0]), f"{hit[1]:.0f}") if hit else ("not reached", "-")
        print(f"| {name} | {points[0][1]:.3f} | {points[-1][1]:.3f} | {step} | {seconds} |")
    print("\n| step | GRPO acc | distill acc |")
    print("|---:|---:|---:|")
    grpo_by_step = {step: accuracy for step, accuracy, _ in teacher}
    for step, accuracy, _ in student:
        shown = f"{grpo_by_step[step]:.3f}" if step in grpo_by_step else "-"
        print(f"| {step} | {shown} | {accuracy:.3f} |")


if __name__ == "__main__":
    main()
