"""EnvironmentActor: the environments of many trajectories, in a process of their own.

An environment runs users' code (and tools, servers, sandboxes): in its own actor a slow one
does not hold up the controller, and one that crashes the process takes only its replica down
(with `env.replicas` > 1 it is a service, and the rollouts lost with it are counted). The
endpoints are concurrent, so the trajectories of every rollout loop step together.
"""

from __future__ import annotations

from typing import Any

from monarch.actor import concurrent_endpoint, endpoint

from forge.controller import ForgeActor
from forge.envs.base import EnvStep
from forge.envs.sessions import EnvFailure, LocalEnvironments, Opening


class EnvironmentActor(ForgeActor):
    def __init__(self, name: str, params: dict[str, Any]):
        self.name, self.params = name, params

    @endpoint
    async def setup(self) -> None:
        self.envs = LocalEnvironments(self.name, self.params)

    @concurrent_endpoint
    async def reset(self, ids: list[str], rows: list[dict]) -> list[Opening | EnvFailure]:
        return await self.envs.reset(ids, rows)

    @concurrent_endpoint
    async def step(self, ids: list[str], texts: list[str]) -> list[EnvStep | EnvFailure]:
        return await self.envs.step(ids, texts)

    @concurrent_endpoint
    async def close(self, ids: list[str]) -> None:
        await self.envs.close(ids)


class ActorEnvironments:
    """``EnvSessions`` over an ``EnvironmentActor`` handle (a lone actor, or a service whose
    calls the caller keeps on one replica with ``handle.session()``)."""

    def __init__(self, handle):
        self.handle = handle

    async def reset(self, ids: list[str], rows: list[dict]) -> list[Opening | EnvFailure]:
        return await self.handle.reset.route(ids, rows)

    async def step(self, ids: list[str], texts: list[str]) -> list[EnvStep | EnvFailure]:
        return await self.handle.step.route(ids, texts)

    async def close(self, ids: list[str]) -> None:
        await self.handle.close.route(ids)
