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

For chat ``messages`` the text is the template's rendering of the whole conversation,
``render(messages)``, and each assistant turn's span is its content as rendered there: a
template may rewrite past turns (Qwen3's strips the ``<think>`` reasoning from assistant
turns before the last user query, and keeps it in the last turn), so the spans are found in
that one rendering, never by rendering the conversation's first turns. For assistant
message ``i``:

- Where the content goes: render the conversation twice more with only message ``i``'s
  content replaced by a sentinel string; the text outside the prefix and suffix that all
  three renderings share is what the template wrote from that content.
- Where the turn starts: the text ``add_generation_prompt`` appends to ``messages[:i]``
  (ChatML: ``<|im_start|>assistant\\n``), at its last occurrence before that content. The
  span runs from there, so what the template writes between that prompt and the content
  (Qwen3's ``<think>\\n`` in the last turn) is trained too: the model writes it at inference.
- The end-of-turn marker: what the template writes after a sentinel content when message
  ``i`` ends the conversation (``render(messages[:i + 1])``), less trailing whitespace; it
  must follow the content in the full rendering.
- The check: rendering the conversation with message ``i``'s content replaced by the span's
  text (its content as rendered) must reproduce the full rendering exactly.

This assumes the template writes each assistant content in one place, opens the turn with
its generation prompt, and closes it with the same marker wherever the turn stands; a
template that breaks one of these is rejected with an error naming the message, rather than
silently mis-masked. For a prefix-stable template (one that renders past turns unchanged)
the spans are the same as incremental rendering's: ``len(render(messages[:i],
add_generation_prompt=True))`` to ``len(render(messages[:i + 1]).rstrip())``.

The end-of-turn marker is trained: the span runs from the assistant content through the
text the template writes to close the turn (ChatML: ``<|im_end|>``), so the model learns
to stop. Trailing whitespace the template writes between turns (ChatML's ``\\n`` after
``<|im_end|>``) is not trained: generation stops at the marker and never produces it.
Likewise a prompt/completion example ends with ``eos_token``, which is trained.

The first token of every example never carries loss: nothing in the example predicts it.
That also keeps packed rows exact (see ``forge.sft.collate``).

The result is one ``input_ids`` list and one ``loss_mask`` list of the same length, where
``loss_mask[t] == 1`` means "token ``t`` is a target" (predicted from tokens ``< t``);
``forge.sft.collate`` applies the shift.
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


# Stand-ins for one assistant message's content, to find where a template writes it (see
# ``_assistant_span``). They differ in their first and last characters, also in any case.
SENTINELS = ("1-forge-sentinel-1", "2-forge-sentinel-2")


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
    spans = [
        _assistant_span(tokenizer, messages, index, text)
        for index, message in enumerate(messages)
        if message["role"] == "assistant"
    ]
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


def _assistant_span(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, Any]], index: int, text: str
) -> tuple[int, int]:
    """The characters of ``text`` (the rendering of all of ``messages``) that assistant
    message ``index`` trains on: its content as rendered there, then the end-of-turn marker."""

    def error(why: str) -> SFTExampleError:
        return SFTExampleError(
            f"cannot locate assistant message {index} in the chat template's rendering of the "
            f"conversation: {why}. The template must write each assistant content in one place, "
            "open the turn with its generation prompt and close it with the same marker wherever "
            "the turn stands (see forge.sft.masking)"
        )

    # Where the content goes: all that changes when only this message's content changes.
    # The two sentinels differ in their first and last characters, so whatever the content
    # is, the three renderings share nothing inside the content's place.
    replaced = [
        render_messages(tokenizer, _with_content(messages, index, sentinel), add_generation_prompt=False)
        for sentinel in SENTINELS
    ]
    content_start = min(_common_prefix_length(text, other) for other in replaced)
    content_end = len(text) - min(
        _common_prefix_length(text[content_start:][::-1], other[content_start:][::-1]) for other in replaced
    )

    # Where the turn starts: right after the generation prompt that opens it.
    history = render_messages(tokenizer, messages[:index], add_generation_prompt=False)
    prompted = render_messages(tokenizer, messages[:index], add_generation_prompt=True)
    if not prompted.startswith(history):
        raise error("rendering with add_generation_prompt=True does not extend rendering without it")
    generation_prompt = prompted[len(history) :]
    prompt_at = text.rfind(generation_prompt, 0, content_start)
    if prompt_at < 0:
        raise error(f"the generation prompt {generation_prompt!r} does not precede the content")
    start = prompt_at + len(generation_prompt)

    # The span must be exactly one rendering of this message: used as its content, it renders
    # back to the same conversation (so it holds no other message's text, and all of this one's).
    as_rendered = _with_content(messages, index, text[start:content_end])
    if render_messages(tokenizer, as_rendered, add_generation_prompt=False) != text:
        raise error(f"its content as located, {text[start:content_end]!r:.200}, does not render back to it")

    # The end-of-turn marker: what closes the turn when it is the last one, as at inference.
    sentinel = SENTINELS[0]
    alone = render_messages(
        tokenizer, _with_content(messages[: index + 1], index, sentinel), add_generation_prompt=False
    )
    if alone.count(sentinel) != 1:
        raise error(f"rendering message {index} last does not write its content exactly once")
    marker = alone[alone.index(sentinel) + len(sentinel) :].rstrip()
    if not text.startswith(marker, content_end):
        raise error(f"the end-of-turn marker {marker!r} (written when the turn is last) does not follow it")
    return start, content_end + len(marker)


def _with_content(messages: Sequence[dict[str, Any]], index: int, content: str) -> list[dict[str, Any]]:
    """A copy of ``messages`` with message ``index``'s content replaced (its other keys kept)."""
    return [{**message, "content": content} if i == index else message for i, message in enumerate(messages)]


def _common_prefix_length(a: str, b: str) -> int:
    # A binary search over slice comparisons, which run in C: a loop over characters would
    # cost a Python step per character of the conversation, for every assistant turn.
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


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
