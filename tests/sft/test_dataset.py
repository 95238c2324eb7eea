"""SFT datasets: loading, loss masks, bad input, and overflow, on real files and tokenizers."""

import json

import datasets
import pytest
from pydantic import ValidationError
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from forge.sft.dataset import SFTDataConfig, build_sft_data, build_sft_loader, generation_eval_rows
from forge.sft.masking import render_messages

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,!?:;'\n-+=*/()"

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "5."},
    {"role": "user", "content": "And 4*4? Explain briefly."},
    {"role": "assistant", "content": "16, since 4+4+4+4 = 16."},
]


def char_tokenizer(chat_template: str | None) -> PreTrainedTokenizerFast:
    """One token per character; ChatML-style eos with a template, <|endoftext|> and a bos without."""
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *CHARS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    if chat_template is None:
        return PreTrainedTokenizerFast(
            tokenizer_object=tokenizer, bos_token="<s>", eos_token="<|endoftext|>", pad_token="<pad>"
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<pad>", chat_template=chat_template
    )


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a small corpus, so tokens span several characters."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [message["content"] for message in CONVERSATION] * 20 + ["system user assistant Sure"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<pad>", chat_template=CHATML_TEMPLATE
    )


def write_rows(path, rows):
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def masked_runs(input_ids, loss_mask):
    """The token runs that carry loss, as lists of ids."""
    runs, current = [], []
    for token, mask in zip(input_ids, loss_mask, strict=True):
        if mask:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return [*runs, current] if current else runs


@pytest.mark.parametrize("tokenizer_kind", ["char", "bpe"])
def test_chat_mask_covers_exactly_the_assistant_turns(tmp_path, tokenizer_kind):
    tokenizer = char_tokenizer(CHATML_TEMPLATE) if tokenizer_kind == "char" else bpe_tokenizer()
    path = write_rows(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    example = build_sft_data(SFTDataConfig(path=path), tokenizer).train[0]

    # The tokens are the whole rendered conversation...
    rendered = render_messages(tokenizer, CONVERSATION, add_generation_prompt=False)
    assert tokenizer.decode(example["input_ids"]) == rendered
    # ...and the runs that carry loss are exactly each assistant content plus its end marker.
    runs = [tokenizer.decode(run) for run in masked_runs(example["input_ids"], example["loss_mask"])]
    assert runs == [
        message["content"] + "<|im_end|>" for message in CONVERSATION if message["role"] == "assistant"
    ]
    # Token by token: every token outside those runs is untrained.
    trained_text = "".join(
        tokenizer.decode([token])
        for token, mask in zip(example["input_ids"], example["loss_mask"], strict=True)
        if mask
    )
    assert trained_text == "".join(runs)


def test_chat_without_template_uses_the_documented_fallback(tmp_path):
    tokenizer = char_tokenizer(chat_template=None)
    conversation = CONVERSATION[1:3]
    path = write_rows(tmp_path / "chat.jsonl", [{"messages": conversation}])
    example = build_sft_data(SFTDataConfig(path=path), tokenizer).train[0]

    assert tokenizer.decode(example["input_ids"]) == "<s>user: What is 2+3?\nassistant: 5.<|endoftext|>\n"
    runs = [tokenizer.decode(run) for run in masked_runs(example["input_ids"], example["loss_mask"])]
    assert runs == ["5.<|endoftext|>"]
    assert render_messages(tokenizer, conversation[:1], add_generation_prompt=True).endswith("assistant: ")


@pytest.mark.parametrize("extension", [".json", ".jsonl", ".parquet"])
def test_prompt_completion_mask_covers_only_the_completion(tmp_path, extension):
    tokenizer = char_tokenizer(chat_template=None)
    rows = [{"prompt": "Q: 2+2?\nA:", "completion": " 4"}, {"prompt": "Say hi.", "completion": " hi there"}]
    path = write_rows(tmp_path / f"pc{extension}", rows)
    data = build_sft_data(SFTDataConfig(path=path), tokenizer)

    assert len(data.train) == 2
    for row, example in zip(rows, data.train, strict=True):
        ids, mask = example["input_ids"], example["loss_mask"]
        assert tokenizer.decode(ids) == "<s>" + row["prompt"] + row["completion"] + "<|endoftext|>"
        first_trained = mask.index(1)
        assert tokenizer.decode(ids[:first_trained]) == "<s>" + row["prompt"]
        assert tokenizer.decode(ids[first_trained:]) == row["completion"] + "<|endoftext|>"
        assert all(mask[first_trained:])


def test_custom_column_names(tmp_path):
    path = write_rows(tmp_path / "qa.jsonl", [{"question": "Why?", "answer": " Because."}])
    config = SFTDataConfig(
        path=path, format="prompt_completion", prompt_column="question", completion_column="answer"
    )
    example = build_sft_data(config, char_tokenizer(None)).train[0]
    assert char_tokenizer(None).decode(example["input_ids"]) == "<s>Why? Because.<|endoftext|>"


def test_missing_column_names_the_file_the_column_and_the_columns_it_has(tmp_path):
    path = write_rows(tmp_path / "qa.jsonl", [{"prompt": "Why?", "answer": " Because."}])
    with pytest.raises(ValueError, match="missing column 'completion'") as error:
        build_sft_data(SFTDataConfig(path=path, format="prompt_completion"), char_tokenizer(None))
    assert path in str(error.value) and "['prompt', 'answer']" in str(error.value)

    with pytest.raises(ValueError, match="cannot tell the SFT format") as error:
        build_sft_data(SFTDataConfig(path=path), char_tokenizer(None))
    assert path in str(error.value) and "'messages'" in str(error.value)


def test_bad_conversations_name_the_file_the_row_and_the_problem(tmp_path):
    tokenizer = char_tokenizer(CHATML_TEMPLATE)
    good = {"messages": CONVERSATION[1:3]}
    unknown_role = {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}
    path = write_rows(tmp_path / "roles.jsonl", [good, unknown_role])
    with pytest.raises(ValueError, match=r"row 2: message 1 has unknown role 'bot'") as error:
        build_sft_data(SFTDataConfig(path=path), tokenizer)
    assert path in str(error.value)

    path = write_rows(tmp_path / "no_assistant.jsonl", [good, {"messages": CONVERSATION[:2]}])
    with pytest.raises(ValueError, match=r"row 2: conversation has no assistant message") as error:
        build_sft_data(SFTDataConfig(path=path), tokenizer)
    assert path in str(error.value)


@pytest.mark.parametrize("overflow", ["truncate", "drop"])
def test_too_long_examples_are_truncated_or_dropped_and_counted(tmp_path, overflow):
    tokenizer = char_tokenizer(chat_template=None)
    rows = [
        {"prompt": "hi", "completion": " yo"},  # 7 tokens with <s> and eos: fits
        {"prompt": "hi", "completion": " a long completion"},  # too long, still trains after a cut
        {"prompt": "a prompt longer than the limit", "completion": " x"},  # nothing trained after a cut
    ]
    path = write_rows(tmp_path / "pc.jsonl", rows)
    data = build_sft_data(SFTDataConfig(path=path, max_seq_len=12, overflow=overflow), tokenizer)

    if overflow == "truncate":
        assert data.metrics == {"data/train_examples": 2, "data/train_truncated": 1, "data/train_dropped": 1}
        assert tokenizer.decode(data.train[1]["input_ids"]) == "<s>hi a long c"
    else:
        assert data.metrics == {"data/train_examples": 1, "data/train_truncated": 0, "data/train_dropped": 2}
    assert all(len(ids) <= 12 for ids in data.train["input_ids"])
    assert tokenizer.decode(data.train[0]["input_ids"]) == "<s>hi yo<|endoftext|>"


def test_eval_split_from_a_fraction_or_a_file(tmp_path):
    tokenizer = char_tokenizer(chat_template=None)
    rows = [{"prompt": f"p{index}", "completion": f" c{index}"} for index in range(10)]
    path = write_rows(tmp_path / "pc.parquet", rows)

    held_out = build_sft_data(SFTDataConfig(path=path, eval_fraction=0.3, seed=1), tokenizer)
    again = build_sft_data(SFTDataConfig(path=path, eval_fraction=0.3, seed=1), tokenizer)
    assert (len(held_out.train), len(held_out.eval)) == (7, 3)
    assert list(held_out.eval["input_ids"]) == list(again.eval["input_ids"])
    split_ids = [*held_out.train["input_ids"], *held_out.eval["input_ids"]]
    all_ids = build_sft_data(SFTDataConfig(path=path), tokenizer).train["input_ids"]
    assert sorted(map(tuple, split_ids)) == sorted(map(tuple, all_ids))
    assert held_out.metrics["data/eval_examples"] == 3

    eval_path = write_rows(tmp_path / "eval.jsonl", rows[:2])
    separate = build_sft_data(SFTDataConfig(path=path, eval_path=eval_path), tokenizer)
    assert (len(separate.train), len(separate.eval)) == (10, 2)


def test_config_rejects_unknown_keys_and_two_eval_sources():
    with pytest.raises(ValidationError, match="packin"):
        SFTDataConfig(path="x.jsonl", packin=True)
    with pytest.raises(ValidationError, match="not both"):
        SFTDataConfig(path="x.jsonl", eval_path="y.jsonl", eval_fraction=0.1)


def test_packed_loader_from_a_file(tmp_path):
    tokenizer = char_tokenizer(CHATML_TEMPLATE)
    conversations = [{"messages": CONVERSATION[1:3]}, {"messages": CONVERSATION[3:5]}] * 3
    path = write_rows(tmp_path / "chat.jsonl", conversations)
    config = SFTDataConfig(path=path, max_seq_len=128, packing=True, batch_size=2)
    data = build_sft_data(config, tokenizer)
    batch = next(build_sft_loader(config, data))

    assert {key: tuple(value.shape) for key, value in batch.items()} == {
        "input_ids": (2, 127),
        "target_ids": (2, 127),
        "loss_mask": (2, 127),
    }
    trained = tokenizer.decode(batch["target_ids"][batch["loss_mask"].bool()].tolist())
    assert set(trained.split("<|im_end|>")) <= {"5.", "16, since 4+4+4+4 = 16.", ""}


def test_a_template_whose_turn_end_depends_on_the_position_is_rejected(tmp_path):
    # Closes the last message differently, so message 2's end-of-turn marker is ambiguous.
    template = CHATML_TEMPLATE.replace(
        "{{ message['content'] }}", "{{ message['content'] }}{% if loop.last %}!{% endif %}"
    )
    path = write_rows(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    with pytest.raises(ValueError, match=r"row 1: cannot locate assistant message 2 .* end-of-turn marker"):
        build_sft_data(SFTDataConfig(path=path), char_tokenizer(template))


def test_the_generation_eval_reads_chat_prompts_and_their_last_answers(tmp_path):
    chats = [
        [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}],
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "2+2="},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3+3="},
            {"role": "assistant", "content": "6"},
        ],
    ]
    path = write_rows(tmp_path / "chat.jsonl", [{"messages": m} for m in chats])
    rows = generation_eval_rows(SFTDataConfig(path=path, eval_path=path), "target")
    assert rows == [{"prompt": chats[0][:1], "target": "3"}, {"prompt": chats[1][:4], "target": "6"}]
    # Prompt/completion data without a target column: the completion is the target.
    pairs = write_rows(tmp_path / "pairs.jsonl", [{"prompt": "5+5=", "completion": "10"}])
    assert generation_eval_rows(SFTDataConfig(path=pairs, eval_path=pairs), "target") == [
        {"prompt": "5+5=", "target": "10"}
    ]
    opens_with_answer = write_rows(
        tmp_path / "bad.jsonl", [{"messages": [{"role": "assistant", "content": "3"}]}]
    )
    with pytest.raises(ValueError, match=r"bad.jsonl: row 1: the generation eval needs .*~generation_eval"):
        generation_eval_rows(SFTDataConfig(path=opens_with_answer, eval_path=opens_with_answer), "target")
    with pytest.raises(ValueError, match="data.eval_path, which is unset"):
        generation_eval_rows(SFTDataConfig(path=path, eval_fraction=0.5), "target")
