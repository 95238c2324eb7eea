"""parse_args in-process, as an app's main calls it: --print-config output and clean exits."""

import pytest
import yaml

from forge.config import ForgeConfigModel, load_config, parse_args


class Optimizer(ForgeConfigModel):
    lr: float
    weight_decay: float = 0.0


class Trainer(ForgeConfigModel):
    optimizer: Optimizer
    steps: int = 10


class AppConfig(ForgeConfigModel):
    name: str
    output_dir: str
    trainer: Trainer


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "app.yaml"
    path.write_text("name: demo\noutput_dir: runs/${name}\ntrainer:\n  optimizer:\n    lr: 3e-4\n")
    return path


def test_returns_the_validated_config_with_overrides_on_either_side_of_options(config_file):
    config = parse_args(AppConfig, ["trainer.steps=5", "--config", str(config_file), "name=b"])
    assert config == AppConfig(name="b", output_dir="runs/b", trainer={"optimizer": {"lr": 3e-4}, "steps": 5})


def test_print_config_prints_resolved_yaml_that_loads_back_equal(config_file, tmp_path, capsys):
    argv = ["--config", str(config_file), "--print-config", "trainer.optimizer.lr=1e-5"]
    with pytest.raises(SystemExit) as caught:
        parse_args(AppConfig, argv)
    assert caught.value.code == 0
    printed = capsys.readouterr().out
    assert yaml.safe_load(printed) == {
        "name": "demo",
        "output_dir": "runs/demo",
        "trainer": {"optimizer": {"lr": 1e-5, "weight_decay": 0.0}, "steps": 10},
    }
    reloaded = tmp_path / "printed.yaml"
    reloaded.write_text(printed)
    assert load_config(AppConfig, reloaded, []) == load_config(
        AppConfig, config_file, ["trainer.optimizer.lr=1e-5"]
    )


def test_config_errors_exit_2_with_every_problem_and_no_traceback(config_file, capsys):
    with pytest.raises(SystemExit) as caught:
        parse_args(AppConfig, ["--config", str(config_file), "trainer.optimizer.lrr=1", "trainer.steps=many"])
    assert caught.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines()[1:] == [
        "  command-line override 'trainer.optimizer.lrr=1': unknown key 'trainer.optimizer.lrr'. "
        "Did you mean 'lr'? Allowed keys under 'trainer.optimizer': lr, weight_decay",
        "  command-line override 'trainer.steps=many': trainer.steps: expected an integer, got 'many' (str)",
    ]
    assert captured.err.splitlines()[0].endswith(": error: 2 problems in the configuration:")
    assert "Traceback" not in captured.err


def test_override_without_equals_exits_2_with_the_expected_syntax(config_file, capsys):
    with pytest.raises(SystemExit) as caught:
        parse_args(AppConfig, ["--config", str(config_file), "foo"])
    assert caught.value.code == 2
    assert capsys.readouterr().err.endswith(
        ": error: command-line override 'foo': expected KEY=VALUE (e.g. trainer.optimizer.lr=1e-5), "
        "or ~KEY to delete a key\n"
    )


def test_missing_config_file_exits_2_naming_it(tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        parse_args(AppConfig, ["--config", str(tmp_path / "typo.yaml")])
    assert caught.value.code == 2
    assert f"error: config file not found: {tmp_path / 'typo.yaml'}" in capsys.readouterr().err
