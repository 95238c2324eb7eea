"""Environment instances for many trajectories at once, keyed by trajectory id.

``LocalEnvironments`` holds them in this process; the ``EnvironmentActor`` (forge.actors)
holds one inside an actor, so that a slow or crashing environment is isolated and can be
scaled as a service. Either way an environment that raises, or returns something that is not
an ``EnvStep``, fails only its own trajectory: the error comes back as an ``EnvFailure`` (a
string, so it crosses processes whatever the exception was).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from forge.data.chat_prompts import Prompt
from forge.envs.base import Environment, EnvStep, load_environment_class

logger = logging.getLogger(__name__)


@dataclass
class Opening:
    """What ``reset`` gave for one trajectory: its opening messages and the tools it declares
    (single-turn GRPO's ``OneTurn`` opens with the dataset row's prompt, a string or messages)."""

    messages: Prompt
    tools: list[dict] | None


@dataclass
class EnvFailure:
    """An environment call that raised or returned the wrong type: what happened, as text."""

    message: str


class LocalEnvironments:
    """Instances of one ``Environment`` class, created by ``reset`` and dropped by ``close``."""

    def __init__(self, name: str, params: dict[str, Any] | None = None):
        self.cls = load_environment_class(name)
        self.name, self.params = name, dict(params or {})
        self._instances: dict[str, Environment] = {}
        # Build one now, so that bad params fail at start-up, not in every trajectory.
        try:
            self.cls(**self.params)
        except (TypeError, ValueError) as e:
            raise ValueError(f"env.params {self.params} do not fit {name}: {e}") from None

    async def reset(self, ids: list[str], rows: list[dict]) -> list[Opening | EnvFailure]:
        return list(await asyncio.gather(*(self._reset(i, row) for i, row in zip(ids, rows, strict=True))))

    async def step(self, ids: list[str], texts: list[str]) -> list[EnvStep | EnvFailure]:
        return list(await asyncio.gather(*(self._step(i, text) for i, text in zip(ids, texts, strict=True))))

    async def close(self, ids: list[str]) -> None:
        envs = [env for i in ids if (env := self._instances.pop(i, None)) is not None]
        outcomes = await asyncio.gather(*(env.close() for env in envs), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                logger.warning("%s.close() raised %s: %s", self.name, type(outcome).__name__, outcome)

    async def _reset(self, trajectory_id: str, row: dict) -> Opening | EnvFailure:
        try:
            env = self._instances[trajectory_id] = self.cls(**self.params)
            messages = await env.reset(row)
        except Exception as e:
            return self._failure("reset", e)
        if not isinstance(messages, list):
            return EnvFailure(
                f"{self.name}.reset() returned {type(messages).__name__}, not a list of messages"
            )
        return Opening(messages, env.tools)

    async def _step(self, trajectory_id: str, text: str) -> EnvStep | EnvFailure:
        try:
            step = await self._instances[trajectory_id].step(text)
        except Exception as e:
            return self._failure("step", e)
        if not isinstance(step, EnvStep):
            return EnvFailure(f"{self.name}.step() returned {type(step).__name__}, not an EnvStep")
        return step

    def _failure(self, method: str, error: Exception) -> EnvFailure:
        message = f"{self.name}.{method}() raised {type(error).__name__}: {error}"
        logger.warning("%s (the trajectory's group is dropped and counted in rollout/env_failures)", message)
        return EnvFailure(message)
