"""Tool calls as the model writes them, and tool results as the model reads them.

Two formats:

- ``tag``: ``<calc>12+34+5</calc>`` calls the tool ``calc`` with the argument ``12+34+5``, given
  verbatim (``<python>print(1)</python>``: the code as written). Only registered tool names count,
  so any other tag is plain text. It needs no quotes, braces or underscores, so a character-level
  tokenizer of digits, arithmetic, ``<>/`` and lowercase letters can write it. A tag that is not
  closed is not a call. The result comes back as ``<result>46</result>`` (the tag is set by
  ``result_tag``).
- ``json``: the format of chat templates that declare tools (Qwen2.5, Qwen3, Hermes), any number
  of times per turn::

      <tool_call>
      {"name": "calc", "arguments": {"expression": "1+2"}}
      </tool_call>

  A block that is not a JSON object with a known ``name`` and an object of ``arguments`` is a
  call with an ``error``, which the environment answers instead of running it. The result comes
  back as plain text: the chat template wraps tool messages itself (Qwen's ``<tool_response>``).

Calls are found in the order written; a call inside another call's argument is part of that
argument (``<python>print('<calc>1</calc>')</python>`` is one python call).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

ToolCallFormat = Literal["tag", "json"]
FORMATS: tuple[ToolCallFormat, ...] = ("tag", "json")

_JSON_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call: ``arguments`` is the raw argument string in the tag format, the decoded object in
    the json format (the block's text when it could not be decoded). ``error`` says why the call
    cannot be run; None when it can."""

    name: str
    arguments: dict[str, Any] | str
    error: str | None = None


def parse_tool_calls(text: str, format: ToolCallFormat, tool_names: Collection[str]) -> list[ToolCall]:
    """The tool calls in one model turn's decoded ``text``, in order (see the module docstring)."""
    if format == "tag":
        return _parse_tags(text, tool_names)
    if format == "json":
        return [_parse_json_call(body, tool_names) for body in _JSON_CALL.findall(text)]
    raise ValueError(f"unknown tool call format '{format}': the formats are {', '.join(FORMATS)}")


def without_tool_calls(text: str) -> str:
    """``text`` with its json-format tool call blocks taken out (what the model said around them)."""
    return _JSON_CALL.sub("", text).strip()


def _parse_tags(text: str, tool_names: Collection[str]) -> list[ToolCall]:
    if not tool_names:
        return []
    # Non-greedy up to the same name's closing tag: adjacent calls stay apart, and another tool's
    # tags inside an argument stay in it.
    names = "|".join(re.escape(name) for name in sorted(tool_names))
    pattern = re.compile(rf"<({names})>(.*?)</\1>", re.DOTALL)
    return [ToolCall(match[1], match[2]) for match in pattern.finditer(text)]


def _parse_json_call(body: str, tool_names: Collection[str]) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall("", body, f"the tool call is not valid JSON: {e}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall("", body, 'a tool call is a JSON object with a "name" and "arguments"')
    name, arguments = call["name"], call.get("arguments", {})
    if name not in tool_names:
        known = ", ".join(sorted(tool_names)) or "none"
        return ToolCall(name, body, f"unknown tool '{name}': the tools are {known}")
    if not isinstance(arguments, dict):
        return ToolCall(name, body, f'the "arguments" of a call to {name} must be a JSON object')
    return ToolCall(name, arguments)


def tool_result_message(result: str, format: ToolCallFormat, result_tag: str = "result") -> dict[str, str]:
    """The chat message that gives a tool's ``result`` back to the model."""
    content = f"<{result_tag}>{result}</{result_tag}>" if format == "tag" else result
    return {"role": "tool", "content": content}
