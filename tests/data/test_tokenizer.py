"""Character-level tokenizers built locally, saved and loaded back with AutoTokenizer."""

import pytest
from transformers import AutoTokenizer

from forge.data.tokenizer import build_char_tokenizer, embedded_tokenizer

TOY_STRINGS = [
    "37+48=",
    "85",
    "<answer>85</answer>",
    "<think>7 plus 8</think>\n<answer>-15</answer>",
    "  1 * 2 ",
]


@pytest.fixture(scope="module")
def tokenizer():
    return embedded_tokenizer()


def test_special_ids_and_small_vocabulary(tokenizer):
    assert (
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.unk_token_id,
    ) == (
        0,
        1,
        2,
        3,
    )
    assert len(tokenizer) < 128
    assert embedded_tokenizer().get_vocab() == tokenizer.get_vocab()


@pytest.mark.parametrize("text", TOY_STRINGS)
def test_round_trip_one_token_per_character(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == len(text) + 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids[1:]


def test_unknown_characters_map_to_unk(tokenizer):
    ids = tokenizer("1+A", add_special_tokens=False)["input_ids"]
    assert ids[-1] == tokenizer.unk_token_id


def test_save_and_load_with_auto_tokenizer(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert loaded.chat_template == tokenizer.chat_template
    for text in TOY_STRINGS:
        assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
        assert loaded.decode(loaded(text)["input_ids"], skip_special_tokens=True) == text


def test_chat_template_renders_and_masks_the_assistant(tokenizer):
    messages = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == "<bos>1+2=3<eos>"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<bos>1+2="
    encoded = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert encoded["input_ids"] == tokenizer("1+2=3")["input_ids"] + [tokenizer.eos_token_id]
    assert encoded["assistant_masks"] == [0, 0, 0, 0, 0, 1, 1]


def test_duplicate_characters_are_rejected():
    with pytest.raises(ValueError, match=r"duplicate characters \['a'\]"):
        build_char_tokenizer("abca")
