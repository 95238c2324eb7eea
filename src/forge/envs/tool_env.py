"""An environment where the model may call tools before it answers.

The opening messages are the row's ``"prompt"`` (a string is one user message, a list of chat
messages is used as it is). Each model turn is searched for tool calls
(``forge.envs.tool_calls`` describes the formats): every call is answered by one ``"tool"``
message, the calls of a turn running concurrently, and the model gets another turn. A turn
without calls is the final answer and ends the episode, with no reward from here: the run's
reward functions score it.

    env:
      name: forge.envs.tool_env:ToolEnvironment
      params: {tools: [calc], format: tag}
      max_turns: 3

Params:

- ``tools``: built-in tool names (``calc``, ``python``) or import paths of the user's own
  (``forge.envs.tools`` says what they may be); default ``[calc]``.
- ``format``: ``tag`` (``<calc>1+2</calc>``, for small character-level tokenizers) or ``json``
  (``<tool_call>{...}</tool_call>``, for chat templates that declare tools; ``tools`` then holds
  the tools' JSON schemas, which the chat template renders into the prompt). Default ``tag``.
- ``result_tag``: the tag around results in the tag format; default ``result``.
- ``max_calls_per_turn``: calls after these in one turn are answered with an error, not run;
  default 4.
- ``call_reward``: added to the reward for each call that runs (a negative value charges for
  calls); default 0.
- ``call_timeout_s``: seconds a call may take; one past it is answered with an error (and
  cancelled: a user's sync function runs on in its thread until it returns); default 60. The
  whole step has the run's deadline too (``env.step_timeout_s``).
- ``python``: settings of the python tool, ``max_output_chars`` and the fields of
  ``forge.envs.sandbox.SandboxLimits``, e.g. ``{wall_s: 5, memory_mb: 256}``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from forge.data.chat_prompts import check_prompt
from forge.envs.base import DeadlineMissed, Environment, EnvStep, Message, within
from forge.envs.tool_calls import FORMATS, ToolCall, ToolCallFormat, parse_tool_calls, tool_result_message
from forge.envs.tools import Tool, resolve_tool


class ToolEnvironment(Environment):
    """See the module docstring."""

    opens_with_row_prompt = True

    def __init__(
        self,
        tools: Sequence[str] = ("calc",),
        format: ToolCallFormat = "tag",
        result_tag: str = "result",
        max_calls_per_turn: int = 4,
        call_reward: float = 0.0,
        python: dict[str, Any] | None = None,
        call_timeout_s: float = 60.0,
    ):
        if isinstance(tools, str):  # `tools: calc` in YAML, which would be read letter by letter
            raise ValueError(f"env.params.tools must be a list of tool names, got '{tools}'")
        if format not in FORMATS:
            raise ValueError(f"env.params.format: '{format}' is not one of {', '.join(FORMATS)}")
        if max_calls_per_turn < 1:
            raise ValueError(f"env.params.max_calls_per_turn must be at least 1, got {max_calls_per_turn}")
        if call_timeout_s <= 0:
            raise ValueError(f"env.params.call_timeout_s must be positive, got {call_timeout_s}")
        if python is not None and "python" not in tools:
            raise ValueError(
                "env.params.python sets the python tool, but 'python' is not in env.params.tools"
            )
        self._tools: dict[str, Tool] = {}
        for spec in tools:
            tool = resolve_tool(spec, python if spec == "python" else None)
            if tool.name in self._tools:
                raise ValueError(f"env.params.tools: two tools are named '{tool.name}'")
            self._tools[tool.name] = tool
        self.format, self.result_tag = format, result_tag
        self.max_calls_per_turn, self.call_reward = max_calls_per_turn, call_reward
        self.call_timeout_s = call_timeout_s
        # Only the json format's chat templates declare tools; the tag format's prompt teaches them.
        self.tools = [tool.schema for tool in self._tools.values()] if format == "json" else None

    async def reset(self, row: dict) -> list[Message]:
        if "prompt" not in row:
            raise ValueError(f"ToolEnvironment needs a 'prompt' in each row, found the keys {sorted(row)}")
        prompt = row["prompt"]
        check_prompt(prompt, "row['prompt']")
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)

    async def step(self, text: str) -> EnvStep:
        calls = parse_tool_calls(text, self.format, self._tools)
        if not calls:
            return EnvStep(done=True)
        tasks = [asyncio.ensure_future(self._answer(call, index)) for index, call in enumerate(calls)]
        try:
            answers = await asyncio.gather(*tasks)
        finally:
            # When one call raises (a sandbox that cannot start), gather leaves the others running.
            for task in tasks:
                task.cancel()
        ran = sum(call.error is None for call in calls[: self.max_calls_per_turn])
        messages = [tool_result_message(answer, self.format, self.result_tag) for answer in answers]
        return EnvStep(messages, reward=self.call_reward * ran)

    async def _answer(self, call: ToolCall, index: int) -> str:
        if call.error is not None:
            return f"error: {call.error}"
        if index >= self.max_calls_per_turn:
            return f"error: not run, only {self.max_calls_per_turn} calls are run per turn"
        try:
            return await within(self.call_timeout_s, self._tools[call.name](call.arguments))
        except DeadlineMissed:
            return f"error: {call.name} did not answer within {self.call_timeout_s:g} s"
