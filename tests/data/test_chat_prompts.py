"""Prompt rows as strings or chat messages, and their rendering into the generator's ids."""

import json
import logging

import pytest
from pydantic import ValidationError

from forge.data import chat_prompts
from forge.data.chat_prompts import PromptRenderer
from forge.data.prompts import PromptDataConfig, load_prompt_rows, with_origins
from forge.data.tokenizer import EMBEDDED_ALPHABET, build_char_tokenizer, embedded_tokenizer

# Role markers, one message a line, and the assistant's turn opened: every character is in the
# embedded alphabet, so each is one token.
ROLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+2="}]


@pytest.fixture
def tokenizer():
    tokenizer = build_char_tokenizer(EMBEDDED_ALPHABET)
    tokenizer.chat_template = ROLE_TEMPLATE
    return tokenizer


@pytest.fixture
def announced_never(monkeypatch):
    """A process in which string templating has not been announced yet."""
    monkeypatch.setattr(chat_prompts, "_string_templating_announced", False)


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def load(path: str, **settings):
    return load_prompt_rows(PromptDataConfig(source="file", path=path, **settings))[0]


# -- rows ----------------------------------------------------------------------------------


def test_rows_hold_strings_or_messages_from_the_prompt_or_messages_column(tmp_path):
    strings = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "1+2=", "target": "3"}])
    assert load(strings) == [{"prompt": "1+2=", "target": "3"}]
    chats = write_jsonl(tmp_path / "c.jsonl", [{"prompt": MESSAGES, "target": "3"}])
    assert load(chats) == [{"prompt": MESSAGES, "target": "3"}]
    column = write_jsonl(tmp_path / "m.jsonl", [{"messages": MESSAGES, "target": "3"}])
    assert load(column) == [{"prompt": MESSAGES, "target": "3"}]
    renamed = write_jsonl(tmp_path / "r.jsonl", [{"chat": MESSAGES, "target": "3"}])
    assert load(renamed, messages_column="chat") == [{"prompt": MESSAGES, "target": "3"}]
    # Both columns: the prompts win (an SFT set's messages end with the answer).
    sft_like = MESSAGES + [{"role": "assistant", "content": "3"}]
    both = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "1+2=", "messages": sft_like, "target": "3"}])
    assert load(both) == [{"prompt": "1+2=", "target": "3"}]


def test_the_rows_a_run_serves_name_their_file_and_row(tmp_path):
    train = write_jsonl(
        tmp_path / "t.jsonl", [{"prompt": "1+2=", "target": "3"}, {"prompt": "2+2=", "target": "4"}]
    )
    held_out = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "3+2=", "target": "5"}])
    cfg = PromptDataConfig(source="file", path=train, eval_path=held_out)
    rows, evaluation = with_origins(cfg, *load_prompt_rows(cfg))
    assert [r["origin"] for r in rows] == [f"dataset.path {train}, row 1", f"dataset.path {train}, row 2"]
    assert evaluation == [{"prompt": "3+2=", "target": "5", "origin": f"dataset.eval_path {held_out}, row 1"}]
    toy, _ = with_origins(PromptDataConfig(), *load_prompt_rows(PromptDataConfig()))
    assert toy[1]["origin"] == "the toy_task training set, row 2"


def test_a_file_without_a_prompt_or_messages_column_names_both_keys(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "1+2=", "target": "3"}])
    with pytest.raises(ValueError) as error:
        load(path)
    message = str(error.value)
    assert path in message and "'prompt'" in message and "'messages'" in message
    assert "dataset.prompt_column or dataset.messages_column" in message


@pytest.mark.parametrize(
    ("column", "rows", "bad_row", "says"),
    [
        ("prompt", [{"prompt": 7}], 0, "a prompt is a string or a non-empty list"),
        ("prompt", [{"prompt": {"role": "user", "content": "hi"}}], 0, "a prompt is a string"),
        ("prompt", [{"prompt": ["hi", "there"]}], 0, "message 0 is not a dict"),
        ("prompt", [{"prompt": []}], 0, "non-empty list"),
        (
            "messages",
            [{"messages": MESSAGES}, {"messages": [{"role": "robot", "content": "hi"}]}],
            1,
            "role 'robot'",
        ),
        (
            "messages",
            [{"messages": MESSAGES}, {"messages": [{"role": "user"}]}],
            1,
            "needs a string 'content'",
        ),
        ("messages", [{"messages": [{"content": "hi"}]}], 0, "has role None"),
        (
            "prompt",
            [{"prompt": MESSAGES}, {"prompt": [*MESSAGES, {"role": "assistant", "content": "3"}]}],
            1,
            "last",
        ),
    ],
)
def test_a_prompt_of_the_wrong_type_names_the_file_row_and_column(tmp_path, column, rows, bad_row, says):
    path = write_jsonl(tmp_path / "bad.jsonl", [{**r, "target": "3"} for r in rows])
    with pytest.raises(ValueError) as error:
        load(path)
    assert f"{path}: row {bad_row + 1}, column '{column}'" in str(error.value)  # rows count from 1
    assert says in str(error.value)


def test_the_chat_template_setting_is_auto_none_or_an_existing_file(tmp_path):
    assert PromptDataConfig().chat_template == "auto"
    assert PromptDataConfig(chat_template="none").chat_template == "none"
    template = tmp_path / "chat.jinja"
    template.write_text(ROLE_TEMPLATE)
    assert PromptDataConfig(chat_template=str(template)).chat_template == str(template)
    with pytest.raises(ValidationError) as error:
        PromptDataConfig(chat_template=str(tmp_path / "missing.jinja"))
    assert "chat_template" in str(error.value) and "missing.jinja' does not exist" in str(error.value)


# -- rendering -----------------------------------------------------------------------------


def test_messages_are_rendered_by_the_tokenizers_template_under_auto(tokenizer):
    rendered = PromptRenderer(tokenizer, "auto").render(MESSAGES)
    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    assert rendered.ids == expected
    assert rendered.text == "<bos><system>add\n<user>1+2=\n<assistant>"
    assert tokenizer.decode(rendered.ids) == rendered.text


def test_a_template_file_replaces_the_tokenizers(tokenizer, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}:{% endfor %}")
    rendered = PromptRenderer(tokenizer, str(template)).render(MESSAGES)
    assert rendered.text == "add:1+2=:"
    assert rendered.ids == tokenizer("add:1+2=:", add_special_tokens=False).input_ids


def test_messages_without_a_template_are_refused_saying_what_to_set(tokenizer):
    with pytest.raises(ValueError, match="dataset.chat_template is 'none': set dataset.chat_template=auto"):
        PromptRenderer(tokenizer, "none").render(MESSAGES)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has none: set dataset.chat_template to the path of a .jinja"):
        PromptRenderer(tokenizer, "auto").render(MESSAGES)


def test_strings_are_templated_as_one_user_message_under_auto_once_announced(
    tokenizer, caplog, announced_never
):
    renderer = PromptRenderer(tokenizer, "auto")
    with caplog.at_level(logging.WARNING, logger="forge.data.chat_prompts"):
        first, second = renderer.render("1+2="), renderer.render("3+4=")
    as_user = [{"role": "user", "content": "1+2="}]
    assert first.ids == tokenizer.apply_chat_template(as_user, add_generation_prompt=True)["input_ids"]
    assert first.text == "1+2=" and second.text == "3+4="
    [record] = caplog.records
    assert "string prompts are rendered as one user message" in record.getMessage()
    assert "dataset.chat_template=none" in record.getMessage()


def test_strings_are_tokenized_as_they_are_without_a_template(tokenizer):
    assert PromptRenderer(tokenizer, "none").render("1+2=").ids == tokenizer("1+2=").input_ids
    tokenizer.chat_template = None
    assert PromptRenderer(tokenizer, "auto").render("1+2=").ids == tokenizer("1+2=").input_ids


def test_the_embedded_task_is_unchanged_and_says_nothing(caplog, announced_never):
    # Its template adds only the bos the tokenizer adds anyway: the same ids, nothing to announce.
    tokenizer = embedded_tokenizer()
    with caplog.at_level(logging.WARNING, logger="forge.data.chat_prompts"):
        rendered = PromptRenderer(tokenizer, "auto").render("12+34=")
    assert rendered.ids == tokenizer("12+34=").input_ids and rendered.text == "12+34="
    assert not caplog.records


def test_a_bad_prompt_given_to_the_renderer_is_refused(tokenizer):
    with pytest.raises(ValueError, match="prompt: message 0 has role 'robot'"):
        PromptRenderer(tokenizer).render([{"role": "robot", "content": "hi"}])
