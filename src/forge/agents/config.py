"""The `agent` section of a GRPO config: an agent program that talks to the policy over the
OpenAI API (`forge.agents.server`), instead of an environment.

    agent:
      function: my_pkg.agents:solve   # async def solve(client, model, row) -> float | None
      timeout_s: 120
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import Field

from forge.config import ForgeConfigModel

# solve(client: openai.AsyncOpenAI, model: str, row: dict) -> the episode's reward, or None.
AgentFunction = Callable[[Any, str, dict], Awaitable[float | None]]


class AgentConfig(ForgeConfigModel):
    # "package.module:function": an async function (client, model, row) -> float | None: the
    # episode's reward, or None to have reward.functions (and reward.models) score its final
    # answer.
    function: str
    # Seconds one episode may take; past it the episode fails (counted in agent/failures).
    timeout_s: float = Field(300.0, gt=0)
    # Calls one episode may make; a call past them is refused (the agent sees a 400 error).
    max_calls: int = Field(32, ge=1)


def load_agent_function(path: str) -> AgentFunction:
    """The async function named ``"package.module:function"``; raises ``ValueError`` naming
    `agent.function` and what is wrong."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"agent.function: '{path}' is not an import path of the form 'package.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"agent.function: cannot import module '{module_name}' of '{path}': {e}") from None
    function = getattr(module, attr, None)
    if not inspect.iscoroutinefunction(function):
        found = "nothing" if function is None else repr(function)
        raise ValueError(
            f"agent.function: '{path}' must name an async function (client, model, row), found {found}"
        )
    return function
