"""Multi-turn SFT loss masks under templates that rewrite past turns (Qwen3's), on real tokenizers."""

import re

import pytest
from chat_templates import CHATML_TEMPLATE, CONVERSATION, QWEN3_TEMPLATE, WITH_TOOL, bpe_tokenizer

from forge.sft.masking import SFTExampleError, render_messages, tokenize_messages

CHATML_TURN = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.DOTALL)
FALLBACK_TURN = re.compile(r"assistant: (.*?<\|endoftext\|>)", re.DOTALL)


def trained_runs(tokenizer, example):
    """The decoded runs of consecutive tokens that carry loss."""
    runs, current = [], []
    for token, mask in zip(example["input_ids"], example["loss_mask"], strict=True):
        if mask:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return [tokenizer.decode(run) for run in [*runs, current] if run]


def check_trains_on_the_rendered_turns(tokenizer, messages, turn_pattern):
    """The example is the template's rendering of the whole conversation, tokenized once, and
    what carries loss is exactly each assistant turn as rendered there, end marker included."""
    example = tokenize_messages(tokenizer, messages)
    rendered = render_messages(tokenizer, messages, add_generation_prompt=False)
    assert example["input_ids"] == tokenizer(rendered, add_special_tokens=False).input_ids
    expected = turn_pattern.findall(rendered)
    assert len(expected) == sum(message["role"] == "assistant" for message in messages)
    assert trained_runs(tokenizer, example) == expected
    return rendered, example


def test_qwen3_template_trains_on_each_turn_as_the_final_conversation_renders_it():
    tokenizer = bpe_tokenizer(QWEN3_TEMPLATE)
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    # The template is not prefix-stable: the first reply alone keeps its reasoning, but the
    # whole conversation strips it.
    first_reply = tokenizer.apply_chat_template(CONVERSATION[:3], tokenize=False)
    assert "Add 2 and 3." in first_reply and not rendered.startswith(first_reply)

    _, example = check_trains_on_the_rendered_turns(tokenizer, CONVERSATION, CHATML_TURN)
    assert example["input_ids"] == tokenizer(rendered, add_special_tokens=False).input_ids
    # Past turns train without their reasoning, the last turn with it.
    assert trained_runs(tokenizer, example) == [
        "5.<|im_end|>",
        "16.<|im_end|>",
        "<think>\nRepeated addition.\n</think>\n\nSure: 4+4+4+4 = 16.<|im_end|>",
    ]


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, None], ids=["chatml", "fallback"])
def test_prefix_stable_templates_train_on_each_turn_as_before(template):
    tokenizer = bpe_tokenizer(template)
    pattern = CHATML_TURN if template else FALLBACK_TURN
    _, example = check_trains_on_the_rendered_turns(tokenizer, CONVERSATION, pattern)

    # The same spans as incremental rendering, which these templates allow: from the end of
    # the generation prompt to the end of the turn less trailing whitespace.
    end = tokenizer.eos_token
    expected = [
        render_messages(tokenizer, CONVERSATION[: index + 1], add_generation_prompt=False).rstrip()[
            len(render_messages(tokenizer, CONVERSATION[:index], add_generation_prompt=True)) :
        ]
        for index, message in enumerate(CONVERSATION)
        if message["role"] == "assistant"
    ]
    assert trained_runs(tokenizer, example) == expected
    assert expected[0] == CONVERSATION[2]["content"] + end


@pytest.mark.parametrize("template", [QWEN3_TEMPLATE, CHATML_TEMPLATE], ids=["qwen3", "chatml"])
def test_a_tool_result_between_assistant_turns_carries_no_loss(template):
    tokenizer = bpe_tokenizer(template)
    rendered, example = check_trains_on_the_rendered_turns(tokenizer, WITH_TOOL, CHATML_TURN)

    tool_start = rendered.index("144")
    tool_end = tool_start + len("144")
    offsets = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    tool_tokens = [t for t, (start, end) in enumerate(offsets) if start < tool_end and end > tool_start]
    assert tool_tokens and all(example["loss_mask"][t] == 0 for t in tool_tokens)
    if template is QWEN3_TEMPLATE:
        # Rendering up to the tool result keeps the first reply's reasoning, which the whole
        # conversation strips (a later user query follows): not even a prefix of it.
        before_reply = render_messages(tokenizer, WITH_TOOL[:3], add_generation_prompt=True)
        assert not rendered.startswith(before_reply)
        assert trained_runs(tokenizer, example)[:2] == ["calc(12*12)<|im_end|>", "144.<|im_end|>"]


@pytest.mark.parametrize(
    "template",
    [
        # Writes each reply twice, so its content is in no one place.
        CHATML_TEMPLATE.replace(
            "{{ message['content'] }}",
            "{{ message['content'] }}{% if message['role'] == 'assistant' %} / "
            "{{ message['content'] }}{% endif %}",
        ),
        # Opens past replies with a header other than the generation prompt.
        CHATML_TEMPLATE.replace("<|im_start|>{{ message['role'] }}", "<|im_start|>{{ message['role'][:3] }}"),
    ],
    ids=["content-twice", "other-header"],
)
def test_a_template_that_defeats_the_method_is_rejected_naming_the_message(template):
    with pytest.raises(SFTExampleError, match=r"cannot locate assistant message 2 in the chat template"):
        tokenize_messages(bpe_tokenizer(template), CONVERSATION)
