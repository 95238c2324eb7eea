"""ReplayBuffer: the actor joining the rollout loops and the training loop."""

from __future__ import annotations

from monarch.actor import endpoint

from forge.controller import ForgeActor
from forge.data.episode_batch import collate_episodes
from forge.data.episode_buffer import EpisodeBuffer, ReplayBufferConfig
from forge.data.types import Episode


class ReplayBuffer(ForgeActor):
    def __init__(self, cfg: ReplayBufferConfig, pad_id: int):
        self.buffer = EpisodeBuffer(cfg)
        self.pad_id = pad_id

    @endpoint
    async def add(self, episode: Episode) -> None:
        self.buffer.add(episode)

    @endpoint
    async def add_many(self, episodes: list[Episode]) -> None:
        for episode in episodes:
            self.buffer.add(episode)

    @endpoint
    async def sample(self, curr_policy_version: int) -> tuple[list[dict], list[dict], list[int]] | None:
        """`(inputs, targets, policy_versions)`, one inputs/targets dict per dp rank, or None
        while too few fresh episodes are buffered."""
        per_rank = self.buffer.sample(curr_policy_version)
        if per_rank is None:
            return None
        collated = [collate_episodes(episodes, self.pad_id) for episodes in per_rank]
        versions = [ep.policy_version for episodes in per_rank for ep in episodes]
        return [c[0] for c in collated], [c[1] for c in collated], versions

    @endpoint
    async def has_room(self) -> bool:
        """False while full: rollout loops wait on it (backpressure)."""
        return self.buffer.has_room()

    @endpoint
    async def counts(self) -> dict[str, int]:
        """Episodes added, evicted as stale and sampled since the start, and held now."""
        return {**self.buffer.counts, "held": len(self.buffer)}

    @endpoint
    async def state_dict(self) -> dict:
        return self.buffer.state_dict()

    @endpoint
    async def load_state_dict(self, state: dict) -> None:
        self.buffer.load_state_dict(state)
