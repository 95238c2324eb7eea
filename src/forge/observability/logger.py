"""The metric logger: collects every process's metrics and flushes them once per step.

The provisioner spawns one `MetricFetcher` on every proc mesh and registers it with the
single `MetricLoggerActor` (a Monarch controller singleton). On `flush(step)` the logger
pulls the accumulated state from every registered process plus the caller's own,
merges them exactly (see `reduce.py`) and writes one row per step to each backend.
"""

from __future__ import annotations

import asyncio
import logging

from monarch.actor import Actor, endpoint, get_or_spawn_controller
from pydantic import Field

from forge.config import ForgeConfigModel
from forge.observability.backends import (
    ConsoleBackend,
    JsonlBackend,
    MetricBackend,
    TensorBoardBackend,
    WandbBackend,
    WandbConfig,
)
from forge.observability.collector import pop_state
from forge.observability.reduce import Accumulator, merge_states

logger = logging.getLogger(__name__)

FETCHER_MESH_NAME = "metric_fetcher"
_LOGGER_NAME = "forge_metric_logger"


class MetricsConfig(ForgeConfigModel):
    # Every metric of every step on the console, prefixed by the logging actor: the apps' own
    # progress line is the one-line summary, so this is for debugging.
    console: bool = False
    # Keys the console line shows (all when empty); files always get every key.
    console_keys: list[str] = []
    jsonl_path: str | None = None
    tensorboard_dir: str | None = None
    wandb: WandbConfig | None = None
    # Rollout records (apps that generate): one JSON line per episode entering the replay
    # buffer and per eval answer; see forge.rollout.records.
    rollouts_path: str | None = None
    rollouts_every: int = Field(1, ge=1, description="record one group of episodes in N")


def build_backends(cfg: MetricsConfig, run_config: dict | None = None) -> list[MetricBackend]:
    backends: list[MetricBackend] = []
    if cfg.console:
        backends.append(ConsoleBackend(cfg.console_keys or None))
    if cfg.jsonl_path:
        backends.append(JsonlBackend(cfg.jsonl_path))
    if cfg.tensorboard_dir:
        backends.append(TensorBoardBackend(cfg.tensorboard_dir))
    if cfg.wandb is not None:
        backends.append(WandbBackend(cfg.wandb, run_config))
    return backends


class MetricFetcher(Actor):
    """Lives on every proc mesh; hands over what its processes recorded."""

    @endpoint
    async def fetch(self) -> dict[str, Accumulator]:
        return pop_state()


class MetricLoggerActor(Actor):
    def __init__(self):
        self._fetchers: dict[str, MetricFetcher] = {}
        self._backends: list[MetricBackend] = []

    @endpoint
    async def configure(self, cfg: MetricsConfig, run_config: dict | None = None) -> None:
        for backend in self._backends:
            backend.close()
        self._backends = build_backends(cfg, run_config)

    @endpoint
    async def register_fetcher(self, name: str, fetcher: MetricFetcher) -> None:
        self._fetchers[name] = fetcher

    @endpoint
    async def unregister_fetcher(self, name: str) -> None:
        self._fetchers.pop(name, None)

    @endpoint
    async def flush(self, step: int, caller_state: dict[str, Accumulator]) -> dict[str, float]:
        names = list(self._fetchers)
        results = await asyncio.gather(
            *(self._fetchers[n].fetch.call() for n in names), return_exceptions=True
        )
        states = [caller_state]
        for name, result in zip(names, results, strict=True):
            if isinstance(result, BaseException):
                # A mesh that died (a replaced replica): what it had not handed over is lost,
                # and we say so rather than hang the flush.
                logger.warning("metrics of mesh %s are unavailable: %s", name, result)
                self._fetchers.pop(name, None)
                continue
            states.extend(state for _, state in result.items())
        merged = {key: acc.value() for key, acc in sorted(merge_states(states).items())}
        for backend in self._backends:
            backend.log(step, merged)
        return merged

    @endpoint
    async def close(self) -> None:
        for backend in self._backends:
            backend.close()
        self._backends = []


async def _logger_actor() -> MetricLoggerActor:
    return await get_or_spawn_controller(_LOGGER_NAME, MetricLoggerActor)


class MetricLogger:
    """The caller's handle on the global metric logger."""

    def __init__(self, actor: MetricLoggerActor):
        self._actor = actor

    async def flush(self, step: int) -> dict[str, float]:
        """Reduces everything recorded since the last flush and writes it; returns the row."""
        return await self._actor.flush.call_one(step, pop_state())

    async def close(self) -> None:
        await self._actor.close.call_one()


async def get_metric_logger(cfg: MetricsConfig | None = None, run_config: dict | None = None) -> MetricLogger:
    """The global metric logger; configures its backends when `cfg` is given. `run_config`
    (the app's whole config) goes to backends that keep it with the run (W&B)."""
    actor = await _logger_actor()
    if cfg is not None:
        await actor.configure.call_one(cfg, run_config)
        # A run's rows hold what the run records: what this process recorded before (another use
        # of the weight store, an earlier run in the same process) is dropped, not put in step 1.
        pop_state()
    return MetricLogger(actor)


async def register_mesh(mesh_name: str, proc_mesh) -> None:
    """Spawns a fetcher on `proc_mesh` so its processes' metrics reach the logger."""
    fetcher = proc_mesh.spawn(FETCHER_MESH_NAME, MetricFetcher)
    await (await _logger_actor()).register_fetcher.call_one(mesh_name, fetcher)


async def unregister_mesh(mesh_name: str) -> None:
    await (await _logger_actor()).unregister_fetcher.call_one(mesh_name)
