"""The environment interface: what a multi-turn episode talks to.

One ``Environment`` instance serves one trajectory. ``reset`` gets the dataset row and
returns the opening chat messages; then the model and the environment take turns: each
model turn is decoded and given to ``step``, whose ``EnvStep`` says what the environment
answers (messages with role ``"tool"`` or ``"user"``, rendered with the chat template's
formatting for their role and appended as tokens the loss does not train on), the reward
that turn earned, and whether the episode is over.

    class Guess(Environment):
        async def reset(self, row):
            self.secret = int(row["target"])
            return [{"role": "user", "content": "Guess my number (1-100)."}]

        async def step(self, text):
            guess = int(text.strip() or 0)
            if guess == self.secret:
                return EnvStep([], reward=1.0, done=True)
            return EnvStep([{"role": "user", "content": "higher" if guess < self.secret else "lower"}])

A GRPO config names the class by import path: ``env: {name: "pkg.module:Guess", params:
{...}, max_turns: 4}``; ``params`` are passed to ``__init__``. ``tools`` (JSON schemas of
functions, as chat templates that declare tools take them) are given to the chat template
when the opening messages are rendered. ``close`` runs when the trajectory ends, however
it ends.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]


@dataclass
class EnvStep:
    """What the environment answers to one model turn."""

    messages: list[Message] = field(default_factory=list)  # role "tool" or "user"; may be empty
    reward: float = 0.0  # added to the trajectory's reward
    done: bool = False


class Environment:
    """Subclass it and implement ``reset`` and ``step`` (see the module docstring)."""

    # JSON schemas of the tools the model may call, given to the chat template (None: none).
    tools: list[dict] | None = None
    # True when reset(row) opens with the row's "prompt" as it is (a string as one user message):
    # the run then measures the openings against env.max_tokens before any process starts.
    opens_with_row_prompt: bool = False

    def __init__(self, **params: Any):
        if params:
            raise TypeError(
                f"{type(self).__name__} takes no params, got {sorted(params)}: define __init__ to accept them"
            )

    async def reset(self, row: dict) -> list[Message]:
        """The opening chat messages for this dataset row (they end before the model's turn)."""
        raise NotImplementedError

    async def step(self, text: str) -> EnvStep:
        """The environment's answer to the model's latest turn, decoded (special tokens skipped)."""
        raise NotImplementedError

    async def close(self) -> None:
        """Releases what the trajectory held (a server session, a sandbox); runs once, at the end."""

    @classmethod
    async def check_before_run(cls, params: dict[str, Any], sessions: int, row: dict) -> None:
        """Checks, before any process of a run starts, what this environment needs from outside
        it (a server: reachable, ``sessions`` trajectories open at once, the fields it reads);
        raises saying what to fix. ``row``: the run's first training row. Nothing by default:
        an environment of this process alone was built once already, which checks its params."""


class DeadlineMissed(Exception):
    """A call of an environment (or of a tool inside one) did not answer within its deadline."""


async def within(seconds: float, answer: Awaitable) -> Any:
    """``answer``, or ``DeadlineMissed`` once ``seconds`` pass; a ``TimeoutError`` the call raises
    itself (a tool's socket timing out) stays the call's own error."""
    try:
        async with asyncio.timeout(seconds) as deadline:
            return await answer
    except TimeoutError:
        if deadline.expired():
            raise DeadlineMissed from None
        raise


def load_environment_class(name: str) -> type[Environment]:
    """The class named ``"package.module:Class"``; raises ``ValueError`` saying what is wrong."""
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"env.name: '{name}' is not an import path of the form 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"env.name: cannot import module '{module_name}' of '{name}': {e}") from None
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        found = "nothing" if cls is None else repr(cls)
        raise ValueError(f"env.name: '{name}' must name a subclass of forge.envs.Environment, found {found}")
    return cls
