"""load_config end to end on real YAML files: merging, interpolation, and the error messages."""

from pathlib import Path
from textwrap import dedent
from typing import Annotated, Literal

import pytest
from pydantic import Field

from forge.config import ConfigError, ForgeConfigModel, config_to_dict, load_config, save_config


class Optimizer(ForgeConfigModel):
    lr: float
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)


class Trainer(ForgeConfigModel):
    optimizer: Optimizer
    loss: Literal["grpo", "dapo", "gspo"] = "grpo"
    # Infinity (no clipping) is a value here: a field must say so, other numbers are finite.
    max_grad_norm: float | None = Field(default=None, allow_inf_nan=True)
    steps: int = Field(default=100, gt=0)


class RewardFunction(ForgeConfigModel):
    name: str
    weight: float = 1.0


class Dataset(ForgeConfigModel):
    path: str
    split: str = "train"


class RunConfig(ForgeConfigModel):
    name: str
    output_dir: str
    trainer: Trainer
    rewards: list[RewardFunction] = []
    datasets: dict[str, Dataset] = {}


VALID = """\
name: demo
output_dir: runs/${name}
trainer:
  optimizer:
    lr: 3e-4
    weight_decay: 0.1
  loss: dapo
rewards:
  - name: format
  - name: correctness
    weight: 2.0
datasets:
  train: {path: data/train.jsonl}
"""


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(dedent(text))
    return path


def problems_of(schema, config_path, overrides=()) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(schema, config_path, overrides)
    return caught.value.problems


def test_file_overrides_interpolation_and_deletion(tmp_path):
    path = write(tmp_path, VALID)
    config = load_config(
        RunConfig,
        path,
        [
            "name=exp2",
            "trainer.optimizer.lr=1e-5",
            "~trainer.optimizer.weight_decay",
            "rewards[1].weight=0.5",
            "+datasets.eval={path: data/eval.jsonl, split: test}",
        ],
    )
    # The interpolation sees the overridden name, and the deleted key falls back to its default.
    assert config.output_dir == "runs/exp2"
    assert config.trainer.optimizer.lr == 1e-5
    assert config.trainer.optimizer.weight_decay == 0.0
    assert config.trainer.loss == "dapo"
    assert [(r.name, r.weight) for r in config.rewards] == [("format", 1.0), ("correctness", 0.5)]
    assert config.datasets["eval"] == Dataset(path="data/eval.jsonl", split="test")


def test_overrides_alone_without_a_file():
    config = load_config(RunConfig, None, ["name=a", "output_dir=/tmp/${name}", "trainer.optimizer.lr=0.01"])
    assert (config.output_dir, config.trainer.optimizer.lr, config.rewards) == ("/tmp/a", 0.01, [])


def test_unknown_key_in_file_names_path_file_line_suggestion_and_allowed_keys(tmp_path):
    path = write(tmp_path, VALID.replace("    lr: 3e-4", "    lrr: 3e-4"))
    assert problems_of(RunConfig, path, ["trainer.optimizer.lr=1e-5"]) == [
        f"{path}:5: unknown key 'trainer.optimizer.lrr'. Did you mean 'lr'? "
        "Allowed keys under 'trainer.optimizer': lr, weight_decay, betas"
    ]


def test_unknown_top_level_key_without_close_match(tmp_path):
    path = write(tmp_path, VALID + "zzz: 1\n")
    assert problems_of(RunConfig, path) == [
        f"{path}:14: unknown key 'zzz'. Allowed keys at the top level: name, output_dir, trainer, rewards, datasets"
    ]


def test_unknown_key_from_override_names_the_override(tmp_path):
    path = write(tmp_path, VALID)
    assert problems_of(RunConfig, path, ["trainer.optimzer.lr=1e-5"]) == [
        "command-line override 'trainer.optimzer.lr=1e-5': unknown key 'trainer.optimzer'. "
        "Did you mean 'optimizer'? Allowed keys under 'trainer': optimizer, loss, max_grad_norm, steps"
    ]


def test_wrong_type_names_path_value_and_expected_type(tmp_path):
    path = write(tmp_path, VALID)
    assert problems_of(RunConfig, path, ["trainer.optimizer.lr=fast", "trainer.max_grad_norm=[1]"]) == [
        "command-line override 'trainer.optimizer.lr=fast': trainer.optimizer.lr: expected a number, got 'fast' (str)",
        "command-line override 'trainer.max_grad_norm=[1]': trainer.max_grad_norm: "
        "expected a number or null, got [1] (list)",
    ]


def test_constraint_violation_uses_pydantic_sentence_with_the_value(tmp_path):
    assert problems_of(RunConfig, write(tmp_path, VALID), ["trainer.steps=0"]) == [
        "command-line override 'trainer.steps=0': trainer.steps: Input should be greater than 0, got 0 (int)"
    ]


def test_nan_and_infinity_are_refused_where_a_field_does_not_allow_them(tmp_path):
    path = write(tmp_path, VALID)
    assert problems_of(RunConfig, path, ["trainer.optimizer.lr=nan", "rewards[1].weight=-inf"]) == [
        "command-line override 'trainer.optimizer.lr=nan': trainer.optimizer.lr: Input should be a finite "
        "number, got 'nan' (str)",
        "command-line override 'rewards[1].weight=-inf': rewards[1].weight: Input should be a finite "
        "number, got '-inf' (str)",
    ]
    text = VALID.replace("weight: 2.0", "weight: .nan")
    assert problems_of(RunConfig, write(tmp_path, text, "nan.yaml")) == [
        f"{tmp_path / 'nan.yaml'}:11: rewards[1].weight: Input should be a finite number, got nan (float)"
    ]


def test_scalar_where_a_section_belongs_lists_the_section_keys(tmp_path):
    path = write(
        tmp_path, VALID.replace("  optimizer:\n    lr: 3e-4\n    weight_decay: 0.1\n", "  optimizer: 0.1\n")
    )
    assert problems_of(RunConfig, path) == [
        f"{path}:4: trainer.optimizer: expected a mapping with keys lr, weight_decay, betas, got 0.1 (float)"
    ]


def test_missing_required_key_names_path(tmp_path):
    path = write(tmp_path, VALID.replace("    lr: 3e-4\n", ""))
    assert problems_of(RunConfig, path) == [
        f"{path}:4: missing required key 'trainer.optimizer.lr': "
        "add it to the config file or pass trainer.optimizer.lr=VALUE"
    ]


def test_deleting_a_required_key_blames_the_deletion(tmp_path):
    path = write(tmp_path, VALID)
    assert problems_of(RunConfig, path, ["~trainer.optimizer.lr"]) == [
        "command-line override '~trainer.optimizer.lr': missing required key 'trainer.optimizer.lr': "
        "add it to the config file or pass trainer.optimizer.lr=VALUE"
    ]


def test_literal_lists_allowed_values_and_suggests_the_closest(tmp_path):
    path = write(tmp_path, VALID.replace("loss: dapo", "loss: grpp"))
    assert problems_of(RunConfig, path) == [
        f"{path}:7: trainer.loss: expected one of 'grpo', 'dapo', 'gspo', got 'grpp' (str). Did you mean 'grpo'?"
    ]
    assert problems_of(RunConfig, path, ["trainer.loss=ppo2"]) == [
        "command-line override 'trainer.loss=ppo2': trainer.loss: expected one of 'grpo', 'dapo', 'gspo', "
        "got 'ppo2' (str)"
    ]


def test_every_problem_is_reported_at_once_in_lists_and_dicts_of_models(tmp_path):
    path = write(
        tmp_path,
        """\
        name: demo
        output_dir: runs
        trainer:
          optimizer: {lr: 1e-4, weight_decay: heavy}
        rewards:
          - name: format
            wieght: 2
          - weight: 1
        datasets:
          train: {path: a.jsonl, splt: test}
        """,
    )
    with pytest.raises(ConfigError) as caught:
        load_config(RunConfig, path, ["trainer.loss=sft"])
    assert caught.value.problems == [
        f"{path}:4: trainer.optimizer.weight_decay: expected a number, got 'heavy' (str)",
        "command-line override 'trainer.loss=sft': trainer.loss: expected one of 'grpo', 'dapo', 'gspo', "
        "got 'sft' (str)",
        f"{path}:7: unknown key 'rewards[0].wieght'. Did you mean 'weight'? "
        "Allowed keys under 'rewards[0]': name, weight",
        f"{path}:8: missing required key 'rewards[1].name': add it to the config file or pass rewards[1].name=VALUE",
        f"{path}:10: unknown key 'datasets.train.splt'. Did you mean 'split'? "
        "Allowed keys under 'datasets.train': path, split",
    ]
    # One line per problem under a count, so the whole list reads at a glance.
    assert str(caught.value).splitlines() == [
        "5 problems in the configuration:",
        *(f"  {problem}" for problem in caught.value.problems),
    ]


def test_missing_interpolation_target_and_unset_placeholder_name_their_keys(tmp_path):
    path = write(tmp_path, VALID.replace("runs/${name}", "runs/${experiment.name}").replace("3e-4", "???"))
    assert problems_of(RunConfig, path) == [
        f"{path}:2: output_dir: cannot resolve 'runs/${{experiment.name}}': "
        "Interpolation key 'experiment.name' not found",
        f"{path}:5: trainer.optimizer.lr: no value ('???'): "
        "set it in the config file or pass trainer.optimizer.lr=VALUE",
    ]


def test_missing_file_names_the_file(tmp_path):
    path = tmp_path / "nope.yaml"
    assert problems_of(RunConfig, path) == [f"config file not found: {path} (looked for {path.resolve()})"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "name: demo\ntrainer:\n  loss: grpo\n    steps: 3\n",
            ":4:10: invalid YAML: mapping values are not allowed here",
        ),
        (
            "name: demo\ntrainer:\n  optimizer: [1,\n  lr: 2\n",
            ":5:1: invalid YAML: expected ',' or ']', but got '<stream end>' "
            "(while parsing a flow sequence, which starts at line 3)",
        ),
        (
            "name: a\nname: b\n",
            ":2:1: invalid YAML: found duplicate key name (while constructing a mapping, which starts at line 1)",
        ),
        (
            "- a\n- b\n",
            ":1: the top level of a config file must be a mapping of sections (key: value), got a list",
        ),
    ],
)
def test_invalid_yaml_names_file_and_line(tmp_path, text, expected):
    path = write(tmp_path, text)
    assert problems_of(RunConfig, path) == [f"{path}{expected}"]


def test_malformed_overrides_are_all_reported(tmp_path):
    path = write(tmp_path, VALID)
    assert problems_of(RunConfig, path, ["trainer.optimizer.lr", "~trainer.nothing", "rewards=[1,"]) == [
        "command-line override 'trainer.optimizer.lr': expected KEY=VALUE (e.g. trainer.optimizer.lr=1e-5), "
        "or ~KEY to delete a key",
        "command-line override '~trainer.nothing': there is no key 'trainer.nothing' to delete",
        "command-line override 'rewards=[1,': value is not valid YAML: did not find expected node content",
    ]


def test_saved_config_loads_back_equal(tmp_path):
    config = load_config(RunConfig, write(tmp_path, VALID), ["trainer.max_grad_norm=inf"])
    saved = save_config(config, tmp_path / "out" / "run1" / "config.yaml")
    assert load_config(RunConfig, saved, []) == config
    assert config_to_dict(config)["trainer"]["optimizer"]["betas"] == [0.9, 0.999]


class ExactMatchReward(ForgeConfigModel):
    kind: Literal["exact_match"]
    case_sensitive: bool = True


class LengthPenalty(ForgeConfigModel):
    kind: Literal["length_penalty"]
    max_tokens: int


class RewardsConfig(ForgeConfigModel):
    rewards: list[Annotated[ExactMatchReward | LengthPenalty, Field(discriminator="kind")]]


def test_discriminated_union_errors_use_the_chosen_member(tmp_path):
    path = write(
        tmp_path,
        """\
        rewards:
          - {kind: length_penalty, max_tokns: 512}
          - {kind: exact_match, case_sensitive: maybe}
        """,
    )
    assert problems_of(RewardsConfig, path) == [
        f"{path}:2: missing required key 'rewards[0].max_tokens': "
        "add it to the config file or pass rewards[0].max_tokens=VALUE",
        f"{path}:2: unknown key 'rewards[0].max_tokns'. Did you mean 'max_tokens'? "
        "Allowed keys under 'rewards[0]': kind, max_tokens",
        f"{path}:3: rewards[1].case_sensitive: expected a boolean (true or false), got 'maybe' (str)",
    ]
