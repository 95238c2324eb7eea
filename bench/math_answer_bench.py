"""How long `math_answer` takes on hostile answers (issue 10: under 10 ms for \\boxed{1e100000000}).

    .venv/bin/python bench/math_answer_bench.py

Prints one row per input: the best of 5 calls, in milliseconds.
"""

import time

from forge.data.rewards import math_answer

CASES = {
    "\\boxed{42}": "42",
    "\\boxed{1e100000000}": "1",
    "<answer>1e100000000</answer>": "1e100000000",
    "\\boxed{" + "9" * 5000 + "}": "1",
    "\\boxed{2.5e999}": "25e998",
}


def best_ms(response: str, target: str, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        math_answer("p", response, target)
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def main() -> None:
    print("| answer | target | best of 5 (ms) |")
    print("|---|---|---|")
    for response, target in CASES.items():
        print(f"| `{response[:40]}` | `{target[:20]}` | {best_ms(response, target):.3f} |")


if __name__ == "__main__":
    main()
