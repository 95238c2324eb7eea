"""ReplayBuffer: the actor joining the rollout loops and the training loop."""

from __future__ import annotations

from monarch.actor import endpoint

from forge.controller import ForgeActor
from forge.data.types import Episode
from forge.observability.jsonl import JsonlAppender
from forge.replay_buffer import EpisodeBuffer, ReplayBufferConfig
from forge.rl.batch import PolicyBatch


class ReplayBuffer(ForgeActor):
    """`batches_path`, when given, gets one JSON line per training batch: the ids of its
    episodes per rank, in order, which is what replay mode needs to rebuild the batch."""

    def __init__(
        self, cfg: ReplayBufferConfig, pad_id: int, dp_size: int = 1, batches_path: str | None = None
    ):
        self.buffer = EpisodeBuffer(cfg, dp_size)
        self.pad_id = pad_id
        # Appended across resumes (a resume first drops the rows after its checkpoint).
        self._batches_file = JsonlAppender(batches_path) if batches_path is not None else None

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
        if self._batches_file is not None:
            ids = [[ep.episode_id for ep in episodes] for episodes in per_rank]
            self._batches_file.write({"policy_version": curr_policy_version, "episode_ids": ids})
        return [PolicyBatch.from_episodes(episodes, self.pad_id) for episodes in per_rank]

    @endpoint
    async def has_room(self, curr_policy_version: int | None = None) -> bool:
        """False while full (of episodes still fresh at `curr_policy_version`, when given):
        rollout loops wait on it (backpressure)."""
        return self.buffer.has_room(curr_policy_version)

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
