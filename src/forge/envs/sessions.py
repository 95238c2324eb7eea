"""Environment instances for many trajectories at once, keyed by trajectory id.

``LocalEnvironments`` holds them in this process; the ``EnvironmentActor`` (forge.actors)
holds one inside an actor, so that a slow or crashing environment is isolated and can be
scaled as a service. Either way an environment call that raises, returns something of the
wrong type, or takes longer than ``env.step_timeout_s`` fails only its own trajectory: it comes
back as an ``EnvFailure`` (text, so it crosses processes whatever the exception was), which
the rollout counts, logs and retries (``forge.rollout.groups``).

The deadline here covers an environment that awaits too long (a tool that never answers). One
that blocks its thread (``time.sleep``, a busy loop) stops the event loop that would enforce it:
the controller's deadline on the actor's call catches that one, and the actor is killed and
replaced (``forge.actors.environment``). The replacement holds no environment of the
trajectories it did not reset, and answers their calls with an ``EnvFailure`` (``lost``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Literal

from forge.data.chat_prompts import Prompt
from forge.envs.base import DeadlineMissed, Environment, EnvStep, load_environment_class, within

EnvCall = Literal["reset", "step", "close"]
# raised: the environment's code raised; timeout: past env.step_timeout_s; wrong type: reset or
# step returned something else than messages or an EnvStep; lost: no environment holds the
# trajectory (its replica died or hung and was replaced).
FailureKind = Literal["raised", "timeout", "wrong type", "lost"]


@dataclass
class Opening:
    """What ``reset`` gave for one trajectory: its opening messages and the tools it declares
    (single-turn GRPO's ``OneTurn`` opens with the dataset row's prompt, a string or messages)."""

    messages: Prompt
    tools: list[dict] | None


@dataclass
class EnvFailure:
    """An environment call that failed: which call, how, and what happened, as text."""

    call: EnvCall
    kind: FailureKind
    message: str


class LocalEnvironments:
    """Instances of one ``Environment`` class, created by ``reset`` and dropped by ``close``;
    each call of an instance must answer within ``step_timeout_s``."""

    def __init__(self, name: str, params: dict[str, Any] | None = None, *, step_timeout_s: float):
        self.cls = load_environment_class(name)
        self.name, self.params = name, dict(params or {})
        self.step_timeout_s = step_timeout_s
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

    async def close(self, ids: list[str]) -> list[EnvFailure]:
        """Closes the environments of ``ids`` (those this process holds); returns the closes
        that failed."""
        envs = [env for i in ids if (env := self._instances.pop(i, None)) is not None]
        outcomes = await asyncio.gather(*(self._call("close", env.close()) for env in envs))
        return [outcome for outcome in outcomes if isinstance(outcome, EnvFailure)]

    async def _reset(self, trajectory_id: str, row: dict) -> Opening | EnvFailure:
        try:
            env = self._instances[trajectory_id] = self.cls(**self.params)
        except Exception as e:
            return self._raised("reset", e)
        messages = await self._call("reset", env.reset(row))
        if isinstance(messages, EnvFailure):
            return messages
        if not isinstance(messages, list):
            return EnvFailure(
                "reset",
                "wrong type",
                f"{self.name}.reset() returned {type(messages).__name__}, not a list of messages",
            )
        return Opening(messages, env.tools)

    async def _step(self, trajectory_id: str, text: str) -> EnvStep | EnvFailure:
        env = self._instances.get(trajectory_id)
        if env is None:
            return EnvFailure(
                "step",
                "lost",
                f"{self.name}: no environment holds trajectory {trajectory_id} (lost with an "
                "environment replica that died or hung, and was replaced)",
            )
        step = await self._call("step", env.step(text))
        if not isinstance(step, EnvStep | EnvFailure):
            return EnvFailure(
                "step", "wrong type", f"{self.name}.step() returned {type(step).__name__}, not an EnvStep"
            )
        return step

    async def _call(self, call: EnvCall, answer: Awaitable) -> Any:
        """The environment's answer, or an ``EnvFailure`` if it raised or missed the deadline."""
        try:
            return await within(self.step_timeout_s, answer)
        except DeadlineMissed:
            return EnvFailure(
                call,
                "timeout",
                f"{self.name}.{call}() did not answer within env.step_timeout_s={self.step_timeout_s:g} s",
            )
        except Exception as e:
            return self._raised(call, e)

    def _raised(self, call: EnvCall, error: Exception) -> EnvFailure:
        return EnvFailure(call, "raised", f"{self.name}.{call}() raised {type(error).__name__}: {error}")
