"""Prompts from reasoning-gym's procedural task generators (``dataset.source: reasoning_gym``).

    dataset:
      source: reasoning_gym
      reasoning_gym:
        tasks:
          - {name: chain_sum, weight: 2, config: {min_terms: 2, max_terms: 3}}
          - {name: spell_backward}
        size: 2000      # training rows
        eval_size: 100  # held-out rows
        seed: 0

Row ``i`` of ``size + eval_size`` is item ``i`` of a task drawn for it by weight, each task
seeded from ``seed`` and its place in the list. The first ``size`` rows train; the rest are the
eval set, less any whose question is also a training question. Rows are a function of the config
alone, so a run resumes from its cursor's (epoch, position) like the other sources.

A row's target is JSON, ``{"task", "config", "index", "answer"}``: what the ``reasoning_gym``
reward (`forge.rewards.reasoning_gym_reward`) needs to build the same item again and score the
response with the task's own ``score_answer``. The item is rebuilt rather than carried because
its metadata holds tuples and other values that JSON would change (arc tasks then score a
right answer 0.05); the answer is there for the reader, and for the reward to check that it
rebuilt the same item.

Rows are built at start-up, by the start-up checks and again by the dataset actor. Most tasks
take well under 10 ms an item; a few take far longer (sokoban about 0.9 s, futoshiki 0.6 s,
knight_swap 0.4 s, sudoku 0.2 s on a CPU of the test machines), and want a small ``size``.

reasoning-gym is imported only here, when rows are built (it takes about 2 s): install it with
``pip install 'forge[reasoning_gym]'`` (``scripts/install.sh`` does).
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

from pydantic import Field

from forge.config import ForgeConfigModel

Row = dict[str, Any]
INSTALL_HINT = (
    "reasoning-gym is not installed: pip install 'forge[reasoning_gym]' (scripts/install.sh installs it)"
)
# Set by this source for every task, from `size`, `eval_size` and `seed`.
SOURCE_KEYS = ("seed", "size")
# In reasoning-gym 0.1.25 these tasks' items change with Python's string hash seed (set order):
# every process would build other rows from one config. Found by building 40 items of every task
# under two hash seeds; another task that does so shows as errors of the reward, whose check of
# the answer then fails.
HASH_SEED_DEPENDENT_TASKS = frozenset(
    {
        "codeio",
        "intermediate_integration",
        "isomorphic_strings",
        "knight_swap",
        "list_functions",
        "polynomial_multiplication",
        "ransom_note",
        "word_ladder",
    }
)


class ReasoningGymTask(ForgeConfigModel):
    # A reasoning-gym dataset name, e.g. chain_sum (reasoning_gym.factory.DATASETS lists them).
    name: str
    # Relative share of the rows.
    weight: float = Field(1.0, gt=0)
    # The task's own settings (its config dataclass), e.g. {min_terms: 2}; not seed or size.
    config: dict[str, Any] = {}


class ReasoningGymConfig(ForgeConfigModel):
    tasks: list[ReasoningGymTask] = Field(min_length=1)
    size: int = Field(1000, gt=0)
    eval_size: int = Field(100, ge=0)
    seed: int = Field(0, ge=0)
    # A name in reasoning_gym.utils.SYSTEM_PROMPTS ("default", "DeepSeekZero", "simple", "direct",
    # "chain_of_draft"; each asks for the answer in <answer> tags), your own text, or "" for none.
    # With one, a prompt is chat messages (that system message, then the question as the user's);
    # without, the question alone.
    system_prompt: str = "default"


def make_reasoning_gym_rows(cfg: ReasoningGymConfig) -> tuple[list[Row], list[Row]]:
    """(train rows, eval rows), each ``{"prompt", "target"}`` (see the module docstring). Raises
    ``ValueError``, naming the key, for an unknown task or task setting."""
    try:
        import reasoning_gym
        from reasoning_gym.utils import SYSTEM_PROMPTS
    except ImportError as e:
        raise ValueError(f"dataset.source=reasoning_gym: {INSTALL_HINT}") from e

    total = cfg.size + cfg.eval_size
    datasets, configs = [], []
    for position, task in enumerate(cfg.tasks):
        where = f"dataset.reasoning_gym.tasks[{position}]"
        _check_task(task, where)
        config = {
            **task.config,
            "seed": random.Random(f"{cfg.seed}-{position}").randrange(2**32),
            "size": total,
        }
        try:
            datasets.append(reasoning_gym.create_dataset(task.name, **config))
        except (TypeError, ValueError, AssertionError) as e:  # a setting's value the task refuses
            raise ValueError(f"{where}.config: task {task.name!r} refuses {task.config}: {e}") from None
        configs.append(config)

    system_prompt = SYSTEM_PROMPTS.get(cfg.system_prompt, cfg.system_prompt)
    picks = random.Random(cfg.seed).choices(range(len(cfg.tasks)), [t.weight for t in cfg.tasks], k=total)
    rows, questions = [], []
    for index, k in enumerate(picks):
        entry = datasets[k][index]
        question = entry["question"]
        prompt = (
            [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]
            if system_prompt
            else question
        )
        target = encode_target(cfg.tasks[k].name, configs[k], index, entry["answer"])
        rows.append({"prompt": prompt, "target": target})
        questions.append(question)
    seen = set(questions[: cfg.size])
    held_out = [row for row, q in zip(rows[cfg.size :], questions[cfg.size :], strict=True) if q not in seen]
    return rows[: cfg.size], held_out


def _check_task(task: ReasoningGymTask, where: str) -> None:
    from reasoning_gym.factory import DATASETS

    if task.name not in DATASETS or task.name == "composite":  # tasks here are listed, not nested
        known = ", ".join(sorted(n for n in DATASETS if n != "composite"))
        raise ValueError(f"{where}.name: unknown reasoning-gym task {task.name!r}; the tasks are: {known}")
    if task.name in HASH_SEED_DEPENDENT_TASKS and not os.environ.get("PYTHONHASHSEED", "").isdigit():
        raise ValueError(
            f"{where}.name: task {task.name!r} builds other rows in every process unless Python's hash "
            "seed is fixed, so a resumed run and the reward would see other items: export "
            "PYTHONHASHSEED=0 before starting the run, or choose another task"
        )
    fields = sorted(f for f in DATASETS[task.name][1].__dataclass_fields__ if f not in SOURCE_KEYS)
    unknown = sorted(set(task.config) - set(fields))
    if unknown:
        raise ValueError(
            f"{where}.config: task {task.name!r} has no setting {unknown} (seed and size come from "
            f"dataset.reasoning_gym); its settings are: {', '.join(fields)}"
        )


def encode_target(task: str, config: dict[str, Any], index: int, answer: Any) -> str:
    return json.dumps({"task": task, "config": config, "index": index, "answer": str(answer)}, sort_keys=True)


def decode_target(target: str) -> dict[str, Any]:
    """The fields `encode_target` wrote; ``ValueError`` for a target that is not such JSON."""
    try:
        fields = json.loads(target)
    except json.JSONDecodeError:
        fields = None
    if not isinstance(fields, dict) or not {"task", "config", "index", "answer"} <= fields.keys():
        raise ValueError(
            f"the reasoning_gym reward scores rows of dataset.source=reasoning_gym only; this target is "
            f"not one: {target[:200]!r}"
        )
    return fields
