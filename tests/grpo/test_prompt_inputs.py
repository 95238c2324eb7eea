"""Prompts the generator could not render, or that its chat template makes too long, are refused
at start-up (forge.runs.checks.check_run_inputs), before any process starts."""

import json
import shutil

import pytest
from apps.grpo.main import main
from startup_errors import startup_error

from forge.config import ConfigError, load_config
from forge.data.tokenizer import embedded_tokenizer
from forge.grpo.config import GRPOConfig
from forge.runs.checks import check_run_inputs

MESSAGES = [{"role": "user", "content": "1+2="}]
# A long instruction before every prompt: 3 lines of 21 characters, a token each.
PREAMBLE_TEMPLATE = (
    "{{ bos_token }}" + "answer with a number\n" * 3 + "{% for m in messages %}{{ m['content'] }}{% endfor %}"
)


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps({**r, "target": "3"}) + "\n" for r in rows))
    return str(path)


def refused(capsys, argv) -> str:
    return startup_error(main, capsys, argv)


def test_a_prompt_of_the_wrong_type_is_refused_naming_row_and_column(write_grpo_config, tmp_path, capsys):
    rows = write_rows(
        tmp_path / "rows.jsonl", [{"prompt": MESSAGES}, {"prompt": [{"role": "bot", "content": "x"}]}]
    )
    err = refused(
        capsys, ["--config", str(write_grpo_config()), "dataset.source=file", f"dataset.path={rows}"]
    )
    assert f"{rows}: row 2, column 'prompt': message 0 has role 'bot'" in err
    # The run's processes never started: nothing was written to its output directory.
    assert not (tmp_path / "run").exists()


def test_chat_messages_without_a_template_are_refused(write_grpo_config, tmp_path, capsys):
    rows = write_rows(tmp_path / "rows.jsonl", [{"messages": MESSAGES}])
    argv = ["--config", str(write_grpo_config()), "dataset.source=file", f"dataset.path={rows}"]
    err = refused(capsys, [*argv, "dataset.chat_template=none"])
    assert "chat messages need a chat template, but dataset.chat_template is 'none'" in err


def test_a_missing_template_file_names_the_key(write_grpo_config, tmp_path, capsys):
    missing = tmp_path / "chat.jinja"
    err = refused(capsys, ["--config", str(write_grpo_config()), f"dataset.chat_template={missing}"])
    assert "dataset.chat_template" in err and f"'{missing}' does not exist" in err


def test_the_template_is_the_datasets_setting_alone(write_grpo_config):
    """Prompts are rendered in one place, the rollout, with dataset.chat_template: the generator
    samples from ids and has no template setting of its own."""
    config = write_grpo_config()
    assert load_config(GRPOConfig, config, ["dataset.chat_template=none"]).dataset.chat_template == "none"
    with pytest.raises(ConfigError, match="generator.chat_template"):
        load_config(GRPOConfig, config, ["generator.chat_template=none"])


def test_prompt_lengths_are_measured_after_the_chat_template(write_grpo_config, tiny_policy, tmp_path):
    policy = tmp_path / "policy"
    shutil.copytree(tiny_policy, policy)
    tokenizer = embedded_tokenizer()
    tokenizer.chat_template = PREAMBLE_TEMPLATE
    tokenizer.save_pretrained(policy)
    rows = write_rows(tmp_path / "rows.jsonl", [{"prompt": "1+2="}])
    overrides = ["dataset.source=file", f"dataset.path={rows}", "eval.every=0"]
    config = write_grpo_config(policy)

    # 5 tokens as a string; 68 templated, above 64 - 4 + 1 (seq_len - max_tokens + 1).
    with pytest.raises(ValueError, match="1 of 1 training prompts are longer than 61 tokens.*has 68"):
        check_run_inputs(load_config(GRPOConfig, config, overrides))
    check_run_inputs(load_config(GRPOConfig, config, [*overrides, "dataset.chat_template=none"]))
