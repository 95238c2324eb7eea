"""Token ids for the environment's turns of a trajectory, in the chat template's formatting.

A trajectory is never re-tokenized: the model's turns keep the ids it sampled, and only what
the environment says is turned into new ids, appended after them. Those ids are what the chat
template would put between the end of the model's turn and the start of its next one: the
closing of the assistant's message (e.g. ChatML's ``<|im_end|>\\n``, unless the model already
sampled it), the environment's messages formatted for their role, and the opening of the next
assistant turn (the generation prompt).

They are found by rendering a probe conversation, ``[user, assistant: PROBE, *messages]`` with
the generation prompt, and taking the text after ``PROBE``. Only what follows the assistant's
message is read, so a template that renders earlier turns differently once the conversation
goes on (Qwen3 drops past reasoning) gives the same ids as it would for the real conversation.

Without a chat template (``chat_template: none``) the environment's messages are appended as
their plain content, one after another.
"""

from __future__ import annotations

from collections.abc import Sequence

from forge.data.chat_prompts import Message, PromptRenderer

_PROBE_USER = "forgeprobeuser"
_PROBE_ANSWER = "forgeprobeanswer"


class TurnRenderer:
    """Renders opening prompts (``PromptRenderer``) and environment turns for one tokenizer."""

    def __init__(self, prompts: PromptRenderer, stop_token_ids: Sequence[int] = ()):
        self.prompts = prompts
        self.tokenizer = prompts.tokenizer
        # A model turn that ends on one of these has sampled the closing of its message itself.
        self.stop_token_ids = {*stop_token_ids, self.tokenizer.eos_token_id} - {None}

    def environment_text(self, messages: list[Message], model_turn_ids: Sequence[int]) -> str:
        """The text appended after a model turn (``model_turn_ids``, as sampled) for ``messages``."""
        if not self.prompts.has_template:
            return "".join(m["content"] for m in messages)
        probe = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ANSWER}]
        rendered = self.prompts.apply([*probe, *messages], tokenize=False)
        if rendered.count(_PROBE_ANSWER) != 1:
            raise ValueError(
                f"the chat template ({self.prompts.key}={self.prompts.setting}) does not render an "
                "assistant message's content as it is, so the environment's turns cannot be placed "
                "after the model's: use a template that does"
            )
        text = rendered.split(_PROBE_ANSWER, 1)[1]
        if model_turn_ids and model_turn_ids[-1] in self.stop_token_ids:
            sampled_end = self.tokenizer.decode([model_turn_ids[-1]], skip_special_tokens=False)
            text = text.removeprefix(sampled_end)
        return text

    def environment_ids(self, messages: list[Message], model_turn_ids: Sequence[int]) -> list[int]:
        """``environment_text`` as token ids (special tokens in it become their ids)."""
        text = self.environment_text(messages, model_turn_ids)
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []
