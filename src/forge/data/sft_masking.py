"""Tokenize one SFT example and mark which of its tokens carry loss.

Method (the same for both formats, with no tokenizer-specific special cases):

1. Render the example to text, and find the character spans the model must learn to
   write: the completion, or each assistant turn.
2. Tokenize the whole text once with ``return_offsets_mapping=True`` (so the tokenizer
   must be a fast tokenizer) and ``add_special_tokens=False``: the rendered text already
   carries every special token (a chat template writes its own; the fallback template and
   the prompt/completion format write ``bos_token`` where the tokenizer has one).
3. A token carries loss when its first character lies inside a span. A token that starts
   in the prompt and runs into the completion (a merge across the boundary) stays in the
   prompt: at inference the prompt is tokenized alone, so that token is never generated.

For chat ``messages`` the spans come from incremental rendering. For assistant turn ``i``:
``start = len(render(messages[:i], add_generation_prompt=True))`` and
``end = len(render(messages[:i + 1]))``, both in the rendering of the whole conversation.
This assumes the template is prefix-stable (rendering a conversation's first turns gives
a prefix of rendering all of it) and honours ``add_generation_prompt``; templates that
rewrite earlier turns (e.g. ones that strip reasoning from past assistant turns) break the
assumption and are rejected with an error rather than silently mis-masked.

The end-of-turn marker is trained: the span runs from the assistant content through the
text the template writes to close the turn (ChatML: ``<|im_end|>``), so the model learns
to stop. Trailing whitespace the template writes between turns (ChatML's ``\\n`` after
``<|im_end|>``) is not trained: generation stops at the marker and never produces it.
Likewise a prompt/completion example ends with ``eos_token``, which is trained.

The first token of every example never carries loss: nothing in the example predicts it.
That also keeps packed rows exact (see ``sft_collate``).

The result is one ``input_ids`` list and one ``loss_mask`` list of the same length, where
``loss_mask[t] == 1`` means "token ``t`` is a target" (predicted from tokens ``< t``);
``sft_collate`` applies the shift.
"""

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant", "tool")

# Used when the tokenizer has no chat template. Renders, e.g.:
#   <bos>system: Be brief.\nuser: Hi\nassistant: Hello<eos>\n
# and the generation prompt is "assistant: ". eos_token closes each assistant turn so the
# model learns to stop.
FALLBACK_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{{ message['role'] + ': ' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


class SFTExampleError(ValueError):
    """An example that cannot be trained on; the caller adds where it came from."""


def render_messages(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, Any]], add_generation_prompt: bool
) -> str:
    """Render a conversation with the tokenizer's chat template, or FALLBACK_CHAT_TEMPLATE."""
    template = tokenizer.chat_template
    if template is None:
        _require_eos(tokenizer, "the fallback chat rendering closes assistant turns with it")
        template = FALLBACK_CHAT_TEMPLATE
    return tokenizer.apply_chat_template(
        list(messages), chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def tokenize_messages(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, Any]]
) -> dict[str, list[int]]:
    """Tokenize a chat conversation; loss on each assistant turn and its end-of-turn marker."""
    _check_messages(messages)
    text = render_messages(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render_messages(tokenizer, messages[:index], add_generation_prompt=True)
        with_turn = render_messages(tokenizer, messages[: index + 1], add_generation_prompt=False)
        if not (text.startswith(prompt) and text.startswith(with_turn)):
            raise SFTExampleError(
                f"the chat template is not prefix-stable at message {index}: rendering the first "
                "turns of the conversation is not a prefix of rendering all of it, so the assistant "
                "tokens cannot be located; use a template that renders past turns unchanged"
            )
        spans.append((len(prompt), len(with_turn.rstrip())))
    return _tokenize_with_spans(tokenizer, text, spans)


def tokenize_prompt_completion(
    tokenizer: PreTrainedTokenizerBase, prompt: Any, completion: Any
) -> dict[str, list[int]]:
    """Tokenize ``bos_token + prompt + completion + eos_token`` as raw text (no chat
    template); loss on the completion and the eos token."""
    for name, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, str):
            raise SFTExampleError(f"{name} must be a string, got {type(value).__name__}: {value!r:.80}")
    _require_eos(tokenizer, "prompt/completion examples end with it so the model learns to stop")
    prefix = (tokenizer.bos_token or "") + prompt
    text = prefix + completion + tokenizer.eos_token
    return _tokenize_with_spans(tokenizer, text, [(len(prefix), len(text))])


def _tokenize_with_spans(
    tokenizer: PreTrainedTokenizerBase, text: str, spans: list[tuple[int, int]]
) -> dict[str, list[int]]:
    if not tokenizer.is_fast:
        raise TypeError(
            f"SFT loss masks need a fast tokenizer (for offset mappings); got {type(tokenizer).__name__}. "
            "Load it with AutoTokenizer.from_pretrained(..., use_fast=True)."
        )
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    loss_mask = [
        int(end > start and any(span_start <= start < span_end for span_start, span_end in spans))
        for start, end in encoding["offset_mapping"]
    ]
    if loss_mask:
        loss_mask[0] = 0
    return {"input_ids": list(encoding["input_ids"]), "loss_mask": loss_mask}


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise SFTExampleError(f"messages must be a list of {{role, content}} dicts, got {messages!r:.80}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise SFTExampleError(
                f"message {index} must be a dict with 'role' and 'content', got {message!r:.80}"
            )
        if message["role"] not in ROLES:
            raise SFTExampleError(
                f"message {index} has unknown role {message['role']!r}; expected one of {', '.join(ROLES)}"
            )
        if not isinstance(message["content"], str):
            raise SFTExampleError(
                f"message {index} content must be a string, got {type(message['content']).__name__}"
            )
    if not any(message["role"] == "assistant" for message in messages):
        raise SFTExampleError("conversation has no assistant message, so there is nothing to train on")


def _require_eos(tokenizer: PreTrainedTokenizerBase, why: str) -> None:
    if tokenizer.eos_token is None:
        raise ValueError(f"the tokenizer has no eos_token; {why}. Set tokenizer.eos_token.")
