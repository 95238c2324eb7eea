"""Critic: PPO's value model as an actor (forge.engines.titan.value.ValueEngine).

Placed as the reference model is (forge.actors.reference): on the trainer's processes, hosts
and GPUs, with the trainer's parallelism, so that it takes the trainer's data-parallel batches
as they are. Every endpoint is called on all ranks. ``values`` gets every completion on every
rank and returns this rank's data-parallel share; ``critic_values``, the caller's side, joins
the shares back in the completions' order. The rollouts ask for values while the training loop
trains (with stale episodes allowed): the engine computes one call at a time, in the order the
calls came, so that no forward reads weights an optimizer step is changing and every rank runs
its collectives in the same order.
"""

from __future__ import annotations

import asyncio

from monarch.actor import current_rank, endpoint

from forge.actors.engine_checkpoints import EngineCheckpoints
from forge.cuda_threads import to_thread_on
from forge.data.types import Completion
from forge.engines.titan.config import TitanEngineConfig
from forge.engines.titan.shares import Share, join_shares
from forge.observability import Reduce, record_metric
from forge.rl.batch import PolicyBatch


class Critic(EngineCheckpoints):
    def __init__(self, engine: TitanEngineConfig, value_clip: float | None):
        self.engine_config = engine
        self.value_clip = value_clip

    @endpoint
    async def setup(self) -> None:
        from forge.engines.titan.value import ValueEngine
        from forge.rl.losses.value import ValueLoss

        self.engine = ValueEngine(self.engine_config)
        self.loss_fn = ValueLoss(self.value_clip)
        self.busy = asyncio.Lock()

    @endpoint
    async def values(self, completions: list[Completion]) -> Share:
        """This rank's data-parallel share of the completions' response-token values."""
        from forge.engines.titan.value import share_values

        async with self.busy:
            return await to_thread_on(self.engine.device, share_values, self.engine, completions)

    @endpoint
    async def train_step(self, batches: list[PolicyBatch]) -> dict[str, float]:
        """One optimizer step of the value loss; ``batches[r]`` is data-parallel rank r's share,
        the trainer's batches (with ``values`` and ``returns``). Records ``critic/*`` metrics."""
        from forge.engines.titan.value import critic_metrics

        async with self.busy:
            step = await to_thread_on(
                self.engine.device, self.engine.train_step, batches[self.engine.dp_rank], self.loss_fn
            )
        metrics = critic_metrics(step)
        if current_rank().rank == 0:
            for key, value in metrics.items():
                record_metric(key, value, Reduce.MEAN)
        return metrics


async def critic_values(critic, completions: list[Completion]) -> list[list[float]]:
    """Per completion, the critic's value of each response token: one call that all of the
    critic's ranks answer, each for its share."""
    return join_shares(await critic.values.route_per_rank(completions), len(completions))
