"""Agent rollouts: dataset rows -> groups of agent episodes, each an agent program run against
forge's endpoint (`forge.agents.server`), as completions the rest of the pipeline trains on.

Each row's ``group_size`` episodes run at once, every episode with an ``openai.AsyncOpenAI`` of
its own whose base URL is its address on the endpoint. An episode's training sequences are what
its calls sampled (`forge.agents.capture`): one completion, the sequence that holds the final
answer (the one sampled last), carries the others it was split from
(``Completion.split_sequences``), which join its group with its reward and advantage. A number
the agent returns is the episode's reward (``Completion.agent_reward``); None has the reward
functions (and models) score its final answer.

An episode whose agent raises, takes longer than ``timeout_s``, returns anything but a number or
None, or never calls the model fails alone: it leaves its group (a group left empty is lost),
and is counted in ``agent/failures`` and logged, the first of each kind per rollout.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from forge.agents.capture import EpisodeCapture
from forge.agents.config import AgentFunction
from forge.agents.openai_api import AgentSampling
from forge.agents.server import AgentEndpoint
from forge.data.types import Completion
from forge.engines.generation import sample_seed
from forge.observability import Reduce, record_metric
from forge.rollout.groups import Generate
from forge.rollout.trajectories import Trajectory

logger = logging.getLogger(__name__)

POOLS, CONNECTIONS_PER_POOL = 64, 32


@dataclass
class AgentRollouts:
    """A run's agent: its function and endpoint, the longest an episode may take, and the
    temperature training samples at (the eval's greedy calls ask for 0)."""

    function: AgentFunction
    endpoint: AgentEndpoint
    timeout_s: float
    temperature: float
    model: str = "policy"
    # Connection pools the episodes' clients share, episode k using pool k % POOLS: one pool
    # for all would scan every connection for each request (httpx's pool is quadratic in its
    # connections), one per episode would build a client per episode.
    _pools: list[httpx.AsyncClient] | None = None

    async def close(self) -> None:
        """Stops the endpoint and closes the clients' connections."""
        await self.endpoint.stop()
        for pool in self._pools or []:
            await pool.aclose()
        self._pools = None

    def _pool(self, key: int) -> httpx.AsyncClient:
        if self._pools is None:
            limits = httpx.Limits(max_connections=CONNECTIONS_PER_POOL)
            # Plain HTTP to this host: no certificates to load.
            self._pools = [
                httpx.AsyncClient(limits=limits, timeout=self.timeout_s, verify=False) for _ in range(POOLS)
            ]
        return self._pools[key % POOLS]

    async def groups(
        self,
        rows: Sequence[dict],
        sample_keys: Sequence[int] | None,
        group_size: int,
        generate: Generate,
        max_tokens: int,
        temperature: float | None = None,
    ) -> list[list[Completion] | None]:
        """``group_size`` episodes per row as completions; None for a row whose every episode failed."""
        allowed = AgentSampling(self.temperature if temperature is None else temperature, max_tokens)
        keys = sample_keys if sample_keys is not None else [random.getrandbits(62) for _ in rows]
        failures: dict[str, list[str]] = {}
        outcomes = await asyncio.gather(
            *(
                self._episode(row, sample_seed(key, j), generate, allowed, failures)
                for row, key in zip(rows, keys, strict=True)
                for j in range(group_size)
            )
        )
        for kind, reasons in failures.items():
            record_metric(f"agent/failures/{kind}", len(reasons), Reduce.SUM)
            logger.warning("%d agent episodes failed (%s); the first: %s", len(reasons), kind, reasons[0])
        groups = [outcomes[i * group_size : (i + 1) * group_size] for i in range(len(rows))]
        kept = [[c for c in group if c is not None] for group in groups]
        return [group or None for group in kept]

    async def _episode(
        self, row: dict, key: int, generate: Generate, allowed: AgentSampling, failures: dict[str, list[str]]
    ) -> Completion | None:
        import openai

        episode = self.endpoint.open(key, generate, allowed)
        client = openai.AsyncOpenAI(
            base_url=episode.base_url,
            api_key="forge",
            max_retries=0,
            timeout=self.timeout_s,
            http_client=self._pool(key),
        )
        try:
            reward = await asyncio.wait_for(self.function(client, self.model, row), self.timeout_s)
        except TimeoutError:
            failures.setdefault("timeouts", []).append(
                f"no result within agent.timeout_s ({self.timeout_s:g} s)"
            )
            return None
        except Exception as e:
            failures.setdefault("errors", []).append(f"{type(e).__name__}: {e}".splitlines()[0])
            return None
        finally:
            capture = self.endpoint.close(episode)
        if reward is not None and not (isinstance(reward, int | float) and math.isfinite(reward)):
            failures.setdefault("errors", []).append(f"returned {reward!r}, not a finite number or None")
            return None
        sequences = capture.sequences()
        if not sequences:
            failures.setdefault("no_calls", []).append("the agent returned without calling the model")
            return None
        return self._completion(capture, sequences, reward)

    def _completion(
        self, capture: EpisodeCapture, sequences: list[Trajectory], reward: float | None
    ) -> Completion:
        tokenizer = self.endpoint.renderer.tokenizer
        *earlier, final = sequences
        record_metric("agent/calls", capture.calls, Reduce.MEAN)
        record_metric("agent/splits", capture.splits, Reduce.SUM)
        record_metric("agent/retokenized", capture.retokenized(), Reduce.SUM)
        completion = final.to_completion(tokenizer)
        completion.agent_reward = None if reward is None else float(reward)
        completion.split_sequences = [t.to_completion(tokenizer) for t in earlier] or None
        return completion
