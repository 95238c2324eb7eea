"""The records that flow between actors. Plain dataclasses: they are pickled across processes."""

import uuid
from dataclasses import dataclass, field
from typing import Literal

StopReason = Literal["stop", "length"]


@dataclass
class Completion:
    """One sampled response to a prompt, as the generator produced it.

    ``response_ids`` include the stop token when ``stop_reason == "stop"``; ``text`` is the
    decoded response without special tokens. ``logprobs`` has one entry per response token:
    the log-probability under the distribution the token was sampled from (see
    ``forge.engines.generation``). ``policy_version`` is the weights version that produced
    every token: generators never update weights in the middle of a sequence.
    """

    prompt: str
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    text: str
    stop_reason: StopReason
    policy_version: int

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.response_ids):
            raise ValueError(
                f"a completion needs one logprob per response token: got {len(self.logprobs)} logprobs "
                f"for {len(self.response_ids)} tokens"
            )

    @property
    def response_len(self) -> int:
        return len(self.response_ids)


@dataclass
class Episode:
    """A completion on its way to training: scored, given an advantage, and grouped.

    ``reward``, ``reward_breakdown`` (one entry per reward function), ``advantage`` and
    ``ref_logprobs`` start empty and are filled in by the reward, advantage and reference
    stages. Episodes sampled from the same prompt share a ``group_id``; ``episode_id`` names
    one episode in rollout records and in the replay buffer's record of training batches.
    """

    completion: Completion
    target: str
    group_id: str
    reward: float = 0.0
    reward_breakdown: dict[str, float] = field(default_factory=dict)
    advantage: float = 0.0
    ref_logprobs: list[float] | None = None
    episode_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def policy_version(self) -> int:
        return self.completion.policy_version

    @property
    def prompt_len(self) -> int:
        return len(self.completion.prompt_ids)

    @property
    def response_len(self) -> int:
        return self.completion.response_len
