"""The embedded toy task: deterministic, held-out split, correct targets, SFT-readable files."""

import re

import datasets
import pytest
from pydantic import ValidationError

from forge.data.toy_task import ToyTaskConfig, make_splits, write_jsonl


def independent_answer(prompt: str) -> int:
    """Recomputes a target without the module's evaluator: products first, then the rest."""
    expression = prompt.removesuffix("=")
    total = 0
    for sign, term in re.findall(r"([+-]?)(\d+(?:\*\d+)*)", expression):
        value = 1
        for factor in term.split("*"):
            value *= int(factor)
        total += -value if sign == "-" else value
    return total


def test_same_seed_same_rows_other_seed_other_rows():
    cfg = ToyTaskConfig(seed=7, num_train=300, num_eval=50)
    assert make_splits(cfg) == make_splits(cfg)
    assert make_splits(cfg.model_copy(update={"seed": 8}))[0] != make_splits(cfg)[0]


def test_sizes_distinct_rows_and_disjoint_splits_across_seeds():
    train, evaluation = make_splits(ToyTaskConfig(seed=0, num_train=1500, num_eval=150))
    assert len(train) == 1500 and len(evaluation) == 150
    assert len({r["prompt"] for r in train}) == 1500
    _, other_eval = make_splits(ToyTaskConfig(seed=1, num_train=1500, num_eval=150))
    train_prompts = {r["prompt"] for r in train}
    for row in evaluation + other_eval:
        a, b = row["prompt"].removesuffix("=").split("+")
        # Held out together with its commuted form.
        assert row["prompt"] not in train_prompts and f"{b}+{a}=" not in train_prompts


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"operators": ["+", "-", "*"], "num_operands": 3, "max_digits": 3},
        {"min_digits": 2, "max_digits": 2},
    ],
)
def test_targets_are_correct_and_operands_have_the_configured_digits(overrides):
    cfg = ToyTaskConfig(seed=3, num_train=400, num_eval=40, **overrides)
    train, evaluation = make_splits(cfg)
    for row in train + evaluation:
        assert row["target"] == str(independent_answer(row["prompt"]))
        assert row["completion"] == row["target"]
        operands = re.findall(r"\d+", row["prompt"])
        assert len(operands) == cfg.num_operands
        assert all(cfg.min_digits <= len(x) <= cfg.max_digits for x in operands)


def test_tagged_answer_format():
    train, _ = make_splits(ToyTaskConfig(num_train=5, num_eval=1, answer_format="tagged"))
    assert all(row["completion"] == f"<answer>{row['target']}</answer>" for row in train)


def test_too_small_a_problem_space_fails_clearly():
    with pytest.raises(ValueError, match="lower num_train"):
        make_splits(ToyTaskConfig(max_digits=1, num_train=200, num_eval=10))


def test_config_rejects_unknown_keys_and_bad_digits():
    with pytest.raises(ValidationError, match="digts"):
        ToyTaskConfig(digts=2)
    with pytest.raises(ValidationError, match="min_digits"):
        ToyTaskConfig(min_digits=3, max_digits=2)


def test_jsonl_is_readable_by_datasets(tmp_path):
    train, _ = make_splits(ToyTaskConfig(num_train=20, num_eval=2))
    path = write_jsonl(train, tmp_path / "sub" / "train.jsonl")
    loaded = datasets.load_dataset("json", data_files=str(path), split="train")
    assert loaded.column_names == ["prompt", "target", "completion"]
    assert loaded.to_list() == train
    assert [p.name for p in path.parent.iterdir()] == ["train.jsonl"]
