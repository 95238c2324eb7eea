"""Anthropic's Messages API as forge's agent endpoint speaks it: a request turned into the chat
messages the capture and the chat template read (`forge.agents.openai_api` checks its sampling
the same way), and the response built from the samples.

A request's ``system`` becomes a system message; ``text`` blocks are joined into a message's
content; an assistant's ``tool_use`` blocks become its tool calls, and a user's ``tool_result``
blocks become tool messages (each after the user's text, in order), which is how chat templates
that declare tools render them. ``tools`` (``name``, ``description``, ``input_schema``) are
declared to the template as functions. ``top_k`` and a ``tool_choice`` other than ``auto`` or
``none`` are refused like the OpenAI settings that change the sampling distribution.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from forge.agents.openai_api import AgentSampling, ChatRequest, RefusedRequest, parse_chat_request
from forge.data.types import Completion

IGNORED = {"model", "metadata", "service_tier", "thinking"}


def parse_messages_request(body: Any, allowed: AgentSampling) -> ChatRequest:
    """The request as chat messages and settings, or `RefusedRequest` naming the field."""
    if not isinstance(body, dict):
        raise RefusedRequest("the request body must be a JSON object")
    if body.get("top_k") is not None:
        raise RefusedRequest(
            "top_k would change the distribution the policy samples from, which training must see "
            "unchanged: leave it out",
            "top_k",
        )
    choice = body.get("tool_choice")
    if choice is not None and choice.get("type") not in ("auto", "none"):
        raise RefusedRequest(
            f"tool_choice {json.dumps(choice)} would force the model's output: leave it out or use auto",
            "tool_choice",
        )
    if body.get("max_tokens") is None:
        raise RefusedRequest("max_tokens is required", "max_tokens")
    known = {
        "messages",
        "system",
        "tools",
        "tool_choice",
        "max_tokens",
        "temperature",
        "top_p",
        "stop_sequences",
    }
    translated: dict[str, Any] = {
        key: value for key, value in body.items() if key not in known | IGNORED | {"top_k", "stream"}
    }
    translated.update(
        messages=_chat_messages(body.get("system"), body.get("messages")),
        max_tokens=body["max_tokens"],
        temperature=body.get("temperature"),
        top_p=body.get("top_p"),
        stop=body.get("stop_sequences"),
        stream=body.get("stream"),
    )
    if body.get("tools") and (choice or {}).get("type") != "none":
        translated["tools"] = [_function(tool) for tool in body["tools"]]
    return parse_chat_request(translated, allowed)


def _chat_messages(system: Any, messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise RefusedRequest("messages must be a non-empty list of {role, content} objects", "messages")
    chat = [{"role": "system", "content": _text(system)}] if system else []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise RefusedRequest("each message has the role user or assistant", "messages")
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        if message["role"] == "assistant":
            chat.append(_assistant(blocks))
            continue
        text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text")
        if text or not any(b.get("type") == "tool_result" for b in blocks):
            chat.append({"role": "user", "content": text})
        chat += [
            {"role": "tool", "content": _text(b.get("content"))}
            for b in blocks
            if b.get("type") == "tool_result"
        ]
    return chat


def _assistant(blocks: list[dict]) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "".join(b.get("text", "") for b in blocks if b.get("type") == "text"),
    }
    calls = [
        {"type": "function", "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}}
        for b in blocks
        if b.get("type") == "tool_use"
    ]
    if calls:
        message["tool_calls"] = calls
    return message


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(block.get("text", "") for block in content if isinstance(block, dict))


def _function(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise RefusedRequest("tools must be a list of {name, description, input_schema}", "tools")
    function = {"name": tool["name"], "parameters": tool.get("input_schema", {"type": "object"})}
    if "description" in tool:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def message_response(
    model: str, prompt_ids: list[int], sample: Completion, reply: tuple[dict[str, Any], str], stops: list[str]
) -> dict[str, Any]:
    """The `message` object of one sample and the chat reply it became (`openai_api.reply_message`)."""
    message, finish = reply
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        content.append(
            {
                "type": "tool_use",
                "id": f"toolu_{uuid.uuid4().hex[:24]}",
                "name": call["function"]["name"],
                "input": json.loads(call["function"]["arguments"]),
            }
        )
    matched = next((s for s in stops if sample.text.endswith(s)), None)
    stop_reason = {"tool_calls": "tool_use", "length": "max_tokens"}.get(finish, "end_turn")
    if stop_reason == "end_turn" and matched is not None:
        stop_reason = "stop_sequence"
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": matched if stop_reason == "stop_sequence" else None,
        "usage": {"input_tokens": len(prompt_ids), "output_tokens": len(sample.response_ids)},
    }


def error_body(refused: RefusedRequest) -> dict[str, Any]:
    """Anthropic's error shape, which its client raises as ``BadRequestError``."""
    return {"type": "error", "error": {"type": "invalid_request_error", "message": str(refused)}}
