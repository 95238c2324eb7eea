"""Prompts as the generator receives them: a string, or chat messages rendered by a chat template.

A prompt (a dataset row's ``"prompt"``) is a string, or a non-empty list of messages, each a
dict with a ``"role"`` (one of ``ROLES``) and a string ``"content"`` (other keys, e.g.
``tool_calls``, are passed to the template as they are).

The chat template setting (``dataset.chat_template``, copied to ``generator.chat_template``):
``auto`` is the tokenizer's own template, if it has one; a path is the template in that
``.jinja`` file; ``none`` is no template. Then:

- messages are rendered by the template, ``apply_chat_template(messages,
  add_generation_prompt=True)``, which opens the assistant's turn so that the first sampled
  token starts the answer; without a template they are refused;
- a string is rendered as one user message when there is a template (said once per process,
  when this changes its tokens), and tokenized as it is otherwise, ``tokenizer(text).input_ids``
  (with the tokenizer's own special tokens, e.g. a bos).

Each rendered prompt also has a text form, ``Completion.prompt``, which records and reward
functions see: a string prompt as written, chat messages as the template renders them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
Message = dict[str, Any]
Prompt = str | list[Message]


def _check_chat_template_setting(value: str) -> str:
    if value in ("auto", "none") or os.path.isfile(value):
        return value
    raise ValueError(
        f"the chat template file '{value}' does not exist: give 'auto' (the tokenizer's own template), "
        "'none' (no template), or the path of a .jinja file"
    )


# "auto" | "none" | the path of a .jinja file, which must exist.
ChatTemplateSetting = Annotated[str, AfterValidator(_check_chat_template_setting)]


def check_prompt(value: Any, where: str) -> None:
    """Raises a ``ValueError`` starting with ``where`` unless ``value`` is a prompt (see the module
    docstring)."""
    if isinstance(value, str):
        return
    if value is None:  # a file's row without the field reads as null too
        raise ValueError(f"{where}: the prompt is missing or null: give every row a prompt, or drop the row")
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"{where}: a prompt is a string or a non-empty list of {{role, content}} messages, "
            f"got {_show(value)}"
        )
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            problem = f"is not a dict with a role and a content: {_show(message)}"
        elif message.get("role") not in ROLES:
            problem = f"has role {_show(message.get('role'))}; the roles are {', '.join(ROLES)}"
        elif not isinstance(message.get("content"), str):
            problem = f"needs a string 'content', got {_show(message.get('content'))}"
        else:
            continue
        raise ValueError(f"{where}: message {i} {problem}")
    if value[-1]["role"] == "assistant":
        # An SFT conversation ends with its answer: as a prompt, the model would see it.
        raise ValueError(
            f"{where}: the last message is the assistant's; a prompt ends before the assistant's turn "
            "(drop the answer from the messages, or use a column of prompts)"
        )


@dataclass(frozen=True)
class RenderedPrompt:
    ids: list[int]  # what the generator samples from
    text: str  # Completion.prompt: the string as written, or the messages as rendered


# Set once the templating of string prompts has been announced (once per process).
_string_templating_announced = False


class PromptRenderer:
    """Renders prompts with ``tokenizer`` and the chat template setting ``chat_template``; ``key``
    names that setting in error messages."""

    def __init__(self, tokenizer, chat_template: str = "auto", key: str = "dataset.chat_template"):
        self.tokenizer, self.setting, self.key = tokenizer, chat_template, key
        # The text given to apply_chat_template; None there means the tokenizer's own template.
        self._template_text = None
        if chat_template == "none":
            self.has_template = False
        elif chat_template == "auto":
            self.has_template = tokenizer.chat_template is not None
        else:
            self.has_template, self._template_text = True, Path(chat_template).read_text()

    def render(self, prompt: Prompt, tools: list[dict] | None = None) -> RenderedPrompt:
        """``tools`` (JSON schemas) are declared to the chat template, for templates that take them."""
        check_prompt(prompt, "prompt")
        if isinstance(prompt, str):
            if not self.has_template:
                return RenderedPrompt(self.tokenizer(prompt).input_ids, prompt)
            ids = self.apply([{"role": "user", "content": prompt}], tokenize=True, tools=tools)
            self._announce_string_templating(prompt, ids)
            return RenderedPrompt(ids, prompt)
        if not self.has_template:
            raise ValueError(self._no_template_message())
        return RenderedPrompt(
            self.apply(prompt, tokenize=True, tools=tools), self.apply(prompt, tokenize=False, tools=tools)
        )

    def apply(
        self,
        messages: list[Message],
        tokenize: bool,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
    ):
        """The chat template applied to ``messages`` (ids, or text with ``tokenize=False``)."""
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self._template_text,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=tokenize,
            return_dict=False,
        )

    def _announce_string_templating(self, prompt: str, ids: list[int]) -> None:
        """Warns once per process, at the first string whose tokens the template changes (a
        template that adds nothing, like the embedded toy task's, changes nothing to announce)."""
        global _string_templating_announced
        if _string_templating_announced or ids == self.tokenizer(prompt).input_ids:
            return
        _string_templating_announced = True
        source = "the tokenizer's own" if self.setting == "auto" else f"the one in '{self.setting}'"
        logger.warning(
            "string prompts are rendered as one user message by %s chat template (%s=%s), e.g. %r as %d "
            "tokens; set %s=none to tokenize them as they are",
            source,
            self.key,
            self.setting,
            prompt[:40],
            len(ids),
            self.key,
        )

    def _no_template_message(self) -> str:
        if self.setting == "none":
            return (
                f"prompts given as chat messages need a chat template, but {self.key} is 'none': "
                f"set {self.key}=auto (the tokenizer's own template) or {self.key}=PATH.jinja"
            )
        return (
            f"prompts given as chat messages need a chat template, and the tokenizer "
            f"'{self.tokenizer.name_or_path}' has none: set {self.key} to the path of a .jinja template"
        )


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
