"""EnvironmentActor: the environments of many trajectories, in a process of their own.

An environment runs users' code (and tools, servers, sandboxes): in its own actor a slow one
does not hold up the controller, and one that crashes or hangs the process takes only its
replica down. The actors always run as a service (`env.replicas` of them, 1 by default) so
that such a replica is replaced; the trajectories it held fail (``lost``) and are rerun
(forge.rollout.groups). The endpoints are concurrent, so the trajectories of every rollout
loop step together.

Each call has a deadline: the actor's own per environment call (`env.step_timeout_s`,
``LocalEnvironments``), and the controller's on the whole call, a grace longer. An actor that
misses the controller's has a blocked event loop (code that blocks its thread, which no
deadline inside the process can interrupt): it is killed and replaced
(forge.controller.liveness).
"""

from __future__ import annotations

from typing import Any

from monarch.actor import concurrent_endpoint, endpoint

from forge.controller import ForgeActor
from forge.envs.base import EnvStep
from forge.envs.sessions import EnvFailure, LocalEnvironments, Opening

# The controller's deadline on an actor call, beyond the actor's own (env.step_timeout_s): the
# time for the call's message and the answer's to cross.
CALL_GRACE_S = 5.0


class EnvironmentActor(ForgeActor):
    def __init__(self, name: str, params: dict[str, Any], step_timeout_s: float):
        self.name, self.params, self.step_timeout_s = name, params, step_timeout_s

    @endpoint
    async def setup(self) -> None:
        self.envs = LocalEnvironments(self.name, self.params, step_timeout_s=self.step_timeout_s)

    @concurrent_endpoint
    async def reset(self, ids: list[str], rows: list[dict]) -> list[Opening | EnvFailure]:
        return await self.envs.reset(ids, rows)

    @concurrent_endpoint
    async def step(self, ids: list[str], texts: list[str]) -> list[EnvStep | EnvFailure]:
        return await self.envs.step(ids, texts)

    @concurrent_endpoint
    async def close(self, ids: list[str]) -> list[EnvFailure]:
        return await self.envs.close(ids)


class ActorEnvironments:
    """``EnvSessions`` over an ``EnvironmentActor`` service: each call answered within
    `step_timeout_s` and a grace, or its replica is killed and replaced (the call, retried on
    the replacement, is answered with ``lost`` failures). A rollout keeps its calls on one
    replica, which holds its trajectories' state, with ``session()``."""

    def __init__(self, service, step_timeout_s: float):
        self.service = service
        self.deadline_s = step_timeout_s + CALL_GRACE_S

    def session(self):
        return self.service.session()

    async def reset(self, ids: list[str], rows: list[dict]) -> list[Opening | EnvFailure]:
        return await self.service.reset.route_within(self.deadline_s, ids, rows)

    async def step(self, ids: list[str], texts: list[str]) -> list[EnvStep | EnvFailure]:
        return await self.service.step.route_within(self.deadline_s, ids, texts)

    async def close(self, ids: list[str]) -> list[EnvFailure]:
        return await self.service.close.route_within(self.deadline_s, ids)
