"""ReplayBuffer: the actor joining the rollout loops and the training loop."""

from __future__ import annotations

from monarch.actor import endpoint

from forge.controller import ForgeActor
from forge.data.episode_buffer import EpisodeBuffer, ReplayBufferConfig
from forge.data.types import Episode
from forge.rl.batch import PolicyBatch


class ReplayBuffer(ForgeActor):
    def __init__(self, cfg: ReplayBufferConfig, pad_id: int, dp_size: int = 1):
        self.buffer = EpisodeBuffer(cfg, dp_size)
        self.pad_id = pad_id

    @endpoint
    async def add(self, episode: Episode) -> None:
        self.buffer.add(episode)

    @endpoint
    async def add_many(self, episodes: list[Episode]) -> None:
        for episode in episodes:
            self.buffer.add(episode)

    @endpoint
    async def sample(self, curr_policy_version: int) -> list[PolicyBatch] | None:
        """One batch per data-parallel rank, or None while too few fresh episodes are buffered."""
        per_rank = self.buffer.sample(curr_policy_version)
        if per_rank is None:
            return None
        return [PolicyBatch.from_episodes(episodes, self.pad_id) for episodes in per_rank]

    @endpoint
    async def state_dict(self) -> dict:
        return self.buffer.state_dict()

    @endpoint
    async def load_state_dict(self, state: dict) -> None:
        self.buffer.load_state_dict(state)
