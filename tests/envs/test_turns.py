"""The environment's turns in the chat template's formatting, under ChatML and Qwen3's template
(which rewrites past turns), with a real byte-level BPE tokenizer."""

import pytest
from chat_templates import CHATML_TEMPLATE, QWEN3_TEMPLATE, bpe_tokenizer

from forge.data.chat_prompts import PromptRenderer
from forge.envs.turns import TurnRenderer

QUESTION = [{"role": "user", "content": "What is 12*12? Use the calculator."}]
CALL = "calc(12*12)"
RESULT = [{"role": "tool", "content": "144"}]


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, QWEN3_TEMPLATE], ids=["chatml", "qwen3"])
def test_the_sequence_is_what_the_template_renders_for_the_whole_conversation(template):
    tokenizer = bpe_tokenizer(template)
    turns = TurnRenderer(PromptRenderer(tokenizer, "auto"))
    opening = turns.prompts.render(QUESTION)
    # The model's turn as sampled, ending with its end-of-message token.
    sampled = tokenizer.encode(CALL, add_special_tokens=False) + [
        tokenizer.convert_tokens_to_ids("<|im_end|>")
    ]
    env = turns.environment_ids(RESULT, sampled)
    conversation = [*QUESTION, {"role": "assistant", "content": CALL}, *RESULT]
    expected = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(opening.ids + sampled + env) == expected
    # The environment's ids start after the sampled end token, and open the next assistant turn.
    assert tokenizer.decode(env).startswith("\n<|im_start|>")
    assert tokenizer.decode(env).endswith("<|im_start|>assistant\n")


def test_a_turn_cut_by_a_stop_string_gets_the_message_closing_from_the_environment():
    tokenizer = bpe_tokenizer(CHATML_TEMPLATE)
    turns = TurnRenderer(PromptRenderer(tokenizer, "auto"))
    sampled = tokenizer.encode(CALL, add_special_tokens=False)  # no <|im_end|>: a stop string ended it
    text = tokenizer.decode(turns.environment_ids(RESULT, sampled))
    assert text == "<|im_end|>\n<|im_start|>tool\n144<|im_end|>\n<|im_start|>assistant\n"


def test_without_a_template_the_messages_are_appended_as_they_are():
    tokenizer = bpe_tokenizer(None)
    turns = TurnRenderer(PromptRenderer(tokenizer, "none"))
    assert turns.environment_text([*RESULT, {"role": "user", "content": " ok"}], [5]) == "144 ok"


def test_a_template_that_changes_the_assistants_words_is_refused():
    tokenizer = bpe_tokenizer(
        CHATML_TEMPLATE.replace("{{ message['content'] }}", "{{ message['content'] | upper }}")
    )
    turns = TurnRenderer(PromptRenderer(tokenizer, "auto"))
    with pytest.raises(ValueError, match="does not render an assistant message's content as it is"):
        turns.environment_ids(RESULT, [5])
