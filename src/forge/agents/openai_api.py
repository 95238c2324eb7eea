"""OpenAI's chat completions API as forge's agent endpoint speaks it: a request checked against
what training allows, and the response built from the generator's samples.

Training needs the tokens sampled from the policy as the loss sees it, so a request may not ask
for anything that changes the sampling distribution: a temperature other than the run's
(``temperature`` may be left out), nucleus or top-k filtering, penalties, a logit bias, forced
tool calls or structured output. Such a request is refused with OpenAI's error shape (HTTP 400,
the offending ``param`` named), which the ``openai`` client raises as ``BadRequestError``.
Settings that only shape the answer (``n``, ``max_tokens`` up to the run's limit, ``stop``,
``logprobs``, ``tools``) are honoured; bookkeeping fields (``model``, ``user``, ``metadata``,
``store``, ``seed``: forge seeds every call of an episode itself) are ignored.

Tool calls are read from the model's text in the format of chat templates that declare tools
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, `forge.envs.tool_calls`); the
reply's ``content`` is the text around them.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from forge.data.types import Completion
from forge.envs.tool_calls import parse_tool_calls, without_tool_calls

# Fields that change nothing when left at these values, and are refused otherwise.
NEUTRAL = {"top_p": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "top_logprobs": 0}
IGNORED = {"model", "user", "metadata", "store", "seed", "parallel_tool_calls", "stream_options"}
HONOURED = {"messages", "temperature", "n", "max_tokens", "max_completion_tokens", "stop", "logprobs"}
TOOLS = {"tools", "tool_choice"}


class RefusedRequest(ValueError):
    """A request forge does not serve; ``param`` is the field to change, ``code`` OpenAI's code
    for the case where it has one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code

    def body(self) -> dict[str, Any]:
        error = {
            "message": str(self),
            "type": "invalid_request_error",
            "param": self.param,
            "code": self.code,
        }
        return {"error": error}


@dataclass(frozen=True)
class AgentSampling:
    """What the run allows an agent's call: the loss's temperature, the most tokens a call may
    sample, the most samples a call may ask for."""

    temperature: float
    max_tokens: int
    max_n: int = 16


@dataclass
class ChatRequest:
    """A call's conversation (``messages``), or its text for /completions (``prompt``), and
    its settings."""

    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    n: int = 1
    max_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    tools: list[dict[str, Any]] | None = None


def parse_chat_request(body: Any, allowed: AgentSampling) -> ChatRequest:
    """The request's settings, or `RefusedRequest` naming the field that training cannot allow."""
    _check_fields(body, HONOURED | TOOLS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(_is_message(m) for m in messages):
        raise RefusedRequest("messages must be a non-empty list of {role, content} objects", "messages")
    return ChatRequest(messages=messages, tools=_tools(body), **_sampling(body, allowed))


def parse_completion_request(body: Any, allowed: AgentSampling) -> ChatRequest:
    """A /completions request: its text prompt (one string) and settings."""
    _check_fields(body, (HONOURED - {"messages", "max_completion_tokens"}) | {"prompt"})
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise RefusedRequest("prompt must be one non-empty string", "prompt")
    settings = _sampling(body, allowed)
    # The API's logprobs is a count of alternatives to list; any count returns the sampled
    # tokens' logprobs (forge has no alternatives to list).
    settings["logprobs"] = body.get("logprobs") is not None
    return ChatRequest(prompt=prompt, **settings)


def _check_fields(body: Any, honoured: set[str]) -> None:
    if not isinstance(body, dict):
        raise RefusedRequest("the request body must be a JSON object")
    for key, value in body.items():
        if key in NEUTRAL and value is not None and value != NEUTRAL[key]:
            raise RefusedRequest(
                f"{key}={value} would change the distribution the policy samples from, which training "
                f"must see unchanged: leave {key} out (forge samples with {key}={NEUTRAL[key]})",
                key,
            )
        if key == "stream" and value:
            raise RefusedRequest("streaming is not served: leave stream out or false", key)
        if key not in NEUTRAL.keys() | honoured | IGNORED | {"stream"}:
            raise RefusedRequest(
                f"{key} is not served by forge's training endpoint (it could bias what training sees): "
                "leave it out",
                key,
            )


def _sampling(body: dict, allowed: AgentSampling) -> dict[str, Any]:
    temperature = body.get("temperature")
    if temperature is not None and not math.isclose(temperature, allowed.temperature):
        raise RefusedRequest(
            f"temperature={temperature}: this run trains on samples at temperature {allowed.temperature:g} "
            "(the loss's); leave temperature out or set it to that",
            "temperature",
        )
    n = body.get("n") or 1
    if not isinstance(n, int) or not 1 <= n <= allowed.max_n:
        raise RefusedRequest(f"n={n}: ask for 1 to {allowed.max_n} samples", "n")
    return {
        "n": n,
        "max_tokens": _max_tokens(body, allowed),
        "stop": _stop(body.get("stop")),
        "logprobs": bool(body.get("logprobs")),
    }


def _is_message(message: Any) -> bool:
    return isinstance(message, dict) and isinstance(message.get("role"), str)


def _max_tokens(body: dict, allowed: AgentSampling) -> int:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(key)
    if value is None:
        return allowed.max_tokens
    if not isinstance(value, int) or not 1 <= value <= allowed.max_tokens:
        raise RefusedRequest(
            f"{key}={value}: a call of this run samples 1 to {allowed.max_tokens} tokens", key
        )
    return value


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RefusedRequest("stop must be a string or a list of non-empty strings", "stop")
    return stops


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise RefusedRequest(
            f"tool_choice={json.dumps(choice)} would force the model's output: leave it out or use 'auto'",
            "tool_choice",
        )
    if not tools or choice == "none":
        return None
    if not all(isinstance(t, dict) and isinstance(t.get("function", {}).get("name"), str) for t in tools):
        raise RefusedRequest("tools must be a list of {type: function, function: {name, ...}}", "tools")
    return tools


def reply_message(sample: Completion, tools: list[dict] | None) -> tuple[dict[str, Any], str]:
    """The assistant message a sample becomes, and its finish reason: tool calls parsed from its
    text when tools were declared (a call the tools do not know stays text)."""
    names = [t["function"]["name"] for t in tools or ()]
    calls = [c for c in parse_tool_calls(sample.text, "json", names) if c.error is None] if names else []
    if not calls:
        return {
            "role": "assistant",
            "content": sample.text,
        }, "length" if sample.stop_reason == "length" else "stop"
    content = without_tool_calls(sample.text)
    tool_calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
        }
        for call in calls
    ]
    return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}, "tool_calls"


def chat_completion(
    model: str,
    prompt_ids: list[int],
    samples: list[Completion],
    replies: list[tuple[dict[str, Any], str]],
    tokenizer,
    logprobs: bool,
) -> dict[str, Any]:
    """The `chat.completion` object of a call's samples and their replies."""
    choices = []
    for index, (sample, (message, finish)) in enumerate(zip(samples, replies, strict=True)):
        choice: dict[str, Any] = {
            "index": index,
            "message": message,
            "finish_reason": finish,
            "logprobs": None,
        }
        if logprobs:
            choice["logprobs"] = {"content": _token_logprobs(sample, tokenizer)}
        choices.append(choice)
    return _response("chat.completion", "chatcmpl", model, prompt_ids, samples, choices)


def _token_logprobs(sample: Completion, tokenizer) -> list[dict[str, Any]]:
    entries = []
    for token_id, logprob in zip(sample.response_ids, sample.logprobs, strict=True):
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        entries.append(
            {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}
        )
    return entries


def models_list(model: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "forge"}]}


def text_completion(
    model: str, prompt_ids: list[int], samples: list[Completion], tokenizer, logprobs: bool
) -> dict[str, Any]:
    """The `text_completion` object of a /completions call's samples."""
    choices = []
    for index, sample in enumerate(samples):
        choice: dict[str, Any] = {
            "index": index,
            "text": sample.text,
            "finish_reason": "length" if sample.stop_reason == "length" else "stop",
            "logprobs": None,
        }
        if logprobs:
            tokens = [tokenizer.decode([i], skip_special_tokens=False) for i in sample.response_ids]
            choice["logprobs"] = {
                "tokens": tokens,
                "token_logprobs": list(sample.logprobs),
                "top_logprobs": None,
            }
        choices.append(choice)
    return _response("text_completion", "cmpl", model, prompt_ids, samples, choices)


def _response(
    kind: str,
    id_prefix: str,
    model: str,
    prompt_ids: list[int],
    samples: list[Completion],
    choices: list[dict],
) -> dict[str, Any]:
    completion_tokens = sum(len(s.response_ids) for s in samples)
    return {
        "id": f"{id_prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt_ids) + completion_tokens,
        },
    }
