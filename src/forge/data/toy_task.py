"""The embedded toy task: integer arithmetic problems generated from a seed.

A row is ``{"prompt": "37+48=", "target": "85", "completion": "85"}``: ``target`` is the
answer the reward compares against, ``completion`` is the gold response text for SFT (no
eos: the SFT collator appends it). With ``answer_format="tagged"`` the gold response is
``<answer>85</answer>`` instead; the reward (``forge.rewards.functions.toy_task_reward``)
accepts either. With ``answer_format="calc"`` a row also holds ``messages``, a demonstration
of the calculator tool (``forge.envs.tool_env``, tag format) for multi-turn SFT: the user's
problem, the assistant's call ``<calc>37+48</calc>``, the tool's ``<result>85</result>``, and
the assistant's answer ``85``. The plain format is the default because every generated token costs CPU
time in the demo, and a bare number still gives a clean signal: 1.0 for the right
number, a little for a well-formed wrong one, nothing for anything else.

Difficulty: the default (two operands of one or two digits, ``+`` only) is meant to start
at a modest exact match after a short SFT warm start of a tiny model and to leave GRPO
room to improve; raise ``max_digits``, ``num_operands`` or add operators for harder runs.

Held-out split: a problem belongs to the eval split when a hash of its canonical form
falls under ``eval_fraction``. Membership does not depend on the seed, so the eval split
of any seed is disjoint from the train split of any seed, and because the canonical form
sorts the operands of a sum (or product), ``48+37`` is held out whenever ``37+48`` is.
"""

import hashlib
import json
import logging
import os
import random
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

logger = logging.getLogger(__name__)

Operator = Literal["+", "-", "*"]
Row = dict[str, Any]


class ToyTaskConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    seed: int = Field(default=0, ge=0)
    num_train: int = Field(default=2000, ge=0)
    num_eval: int = Field(default=200, ge=0)
    min_digits: int = Field(default=1, ge=1, description="fewest digits of an operand")
    max_digits: int = Field(default=2, ge=1, le=9, description="most digits of an operand")
    num_operands: int = Field(default=2, ge=2, le=4)
    operators: list[Operator] = Field(default_factory=lambda: ["+"], min_length=1)
    answer_format: Literal["plain", "tagged", "calc"] = "plain"
    eval_fraction: float = Field(
        default=0.1, gt=0.0, lt=1.0, description="share of all possible problems reserved for eval"
    )

    @model_validator(mode="after")
    def _check_digits(self) -> "ToyTaskConfig":
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits ({self.min_digits}) must not exceed max_digits ({self.max_digits})")
        return self


def make_splits(cfg: ToyTaskConfig) -> tuple[list[Row], list[Row]]:
    """Returns ``(train_rows, eval_rows)``: distinct problems in sampling order, the same for
    the same config. Raises ``ValueError`` when the problem space is too small to hold
    that many distinct problems per split."""
    rng = random.Random(cfg.seed)
    train: dict[str, Row] = {}
    evaluation: dict[str, Row] = {}
    # Generous for any request the problem space can satisfy; a hopeless one fails fast.
    max_draws = 50 * (cfg.num_train + cfg.num_eval) + 1000
    draws = 0
    while len(train) < cfg.num_train or len(evaluation) < cfg.num_eval:
        if draws == max_draws:
            raise ValueError(
                f"could only draw {len(train)}/{cfg.num_train} train and {len(evaluation)}/{cfg.num_eval} "
                f"eval distinct problems with max_digits={cfg.max_digits}, num_operands={cfg.num_operands}, "
                f"operators={cfg.operators}: lower num_train/num_eval or make the problems larger"
            )
        draws += 1
        operands = [_draw_operand(rng, cfg) for _ in range(cfg.num_operands)]
        operators = [rng.choice(cfg.operators) for _ in range(cfg.num_operands - 1)]
        split, limit = (
            (evaluation, cfg.num_eval) if _is_eval(operands, operators, cfg) else (train, cfg.num_train)
        )
        prompt = _render(operands, operators) + "="
        if len(split) < limit and prompt not in split:
            target = str(_evaluate(operands, operators))
            split[prompt] = {"prompt": prompt, "target": target, "completion": _gold_response(target, cfg)}
            if cfg.answer_format == "calc":
                split[prompt]["messages"] = calculator_demonstration(prompt, target)
    return list(train.values()), list(evaluation.values())


def write_jsonl(rows: list[Row], path: str | os.PathLike) -> Path:
    """Writes one JSON object per line, via a temporary file and a rename, so that a crash
    never leaves a truncated file behind. Readable by ``datasets.load_dataset("json", ...)``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)
    logger.info("wrote %d rows to %s", len(rows), path)
    return path


def _draw_operand(rng: random.Random, cfg: ToyTaskConfig) -> int:
    # Draw the digit count first, so that short operands are as common as long ones.
    digits = rng.randint(cfg.min_digits, cfg.max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def _render(operands: list[int], operators: list[str]) -> str:
    parts = [str(operands[0])]
    for op, value in zip(operators, operands[1:], strict=True):
        parts += [op, str(value)]
    return "".join(parts)


def _is_eval(operands: list[int], operators: list[str], cfg: ToyTaskConfig) -> bool:
    if len(set(operators)) == 1 and operators[0] in "+*":
        canonical = _render(sorted(operands), operators)
    else:
        canonical = _render(operands, operators)
    digest = hashlib.sha256(canonical.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < cfg.eval_fraction


def _evaluate(operands: list[int], operators: list[str]) -> int:
    """Usual precedence: products first, then sums and differences left to right."""
    terms = [operands[0]]
    signs = [1]
    for op, value in zip(operators, operands[1:], strict=True):
        if op == "*":
            terms[-1] *= value
        else:
            terms.append(value)
            signs.append(1 if op == "+" else -1)
    return sum(sign * term for sign, term in zip(signs, terms, strict=True))


def _gold_response(target: str, cfg: ToyTaskConfig) -> str:
    return f"<answer>{target}</answer>" if cfg.answer_format == "tagged" else target


def calculator_demonstration(prompt: str, target: str) -> list[dict[str, str]]:
    """The calculator tool used as it should be on ``prompt`` (``"37+48="``), as chat messages."""
    return [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": f"<calc>{prompt.removesuffix('=')}</calc>"},
        {"role": "tool", "content": f"<result>{target}</result>"},
        {"role": "assistant", "content": target},
    ]
