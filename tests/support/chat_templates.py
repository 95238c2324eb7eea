"""Chat templates and a small BPE tokenizer for tests of multi-turn rendering (SFT masks, env turns)."""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The logic of Qwen3's chat template (tool definitions and tool calls left out): ChatML turns,
# tool results wrapped in a user turn, and the reasoning of every assistant turn before the
# last user query stripped, while the turns after it keep theirs in a <think> block.
QWEN3_TEMPLATE = """
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>')
        and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in message.content %}
            {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
            {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n')
                .split('<think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n')
                + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

SPECIAL_TOKENS = ["<pad>", "<s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "<think>\nAdd 2 and 3.\n</think>\n\n5."},
    {"role": "user", "content": "And 4*4?"},
    {"role": "assistant", "content": "<think>\nFour fours.\n</think>\n\n16."},
    {"role": "user", "content": "Explain briefly."},
    {"role": "assistant", "content": "<think>\nRepeated addition.\n</think>\n\nSure: 4+4+4+4 = 16."},
]

WITH_TOOL = [
    {"role": "user", "content": "What is 12*12? Use the calculator."},
    {"role": "assistant", "content": "<think>\nCall the tool.\n</think>\n\ncalc(12*12)"},
    {"role": "tool", "content": "144"},
    {"role": "assistant", "content": "<think>\nThe tool said 144.\n</think>\n\n144."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "<think>\nBe polite.\n</think>\n\nYou are welcome."},
]


def bpe_tokenizer(chat_template: str | None) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on the conversations, so tokens span several characters;
    without a template it has the bos and eos the fallback template writes."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [message["content"] for message in CONVERSATION + WITH_TOOL] * 20 + [
        "system user assistant"
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    common = {"tokenizer_object": tokenizer, "pad_token": "<pad>", "clean_up_tokenization_spaces": False}
    if chat_template is None:
        return PreTrainedTokenizerFast(**common, bos_token="<s>", eos_token="<|endoftext|>")
    return PreTrainedTokenizerFast(**common, eos_token="<|im_end|>", chat_template=chat_template)
