"""The records that flow between actors. Plain dataclasses: they are pickled across processes."""

import uuid
from dataclasses import dataclass, field
from typing import Literal

StopReason = Literal["stop", "length"]


@dataclass
class Turn:
    """One part of a multi-turn response, for records and rewards: who wrote it (``"assistant"``
    for the model, else the environment's role), its text, how many response tokens it spans,
    and the reward the environment gave for the model turn it answers."""

    role: str
    text: str
    num_tokens: int
    reward: float = 0.0


@dataclass
class Completion:
    """One sampled response to a prompt, as the generator produced it, or a whole multi-turn
    trajectory (``forge.rollout.trajectories``).

    ``response_ids`` include the stop token when ``stop_reason == "stop"``; ``text`` is the
    decoded response without special tokens. ``logprobs`` has one entry per response token:
    the log-probability under the distribution the token was sampled from (see
    ``forge.engines.generation``). ``policy_version`` is the oldest weights version that
    produced a token: what staleness is measured by.

    A trajectory's response is every token after the opening prompt: model turns and the
    environment's turns between them. ``response_mask`` is 1 on the model's tokens and 0 on the
    environment's (None: all the model's), whose logprobs are 0.0 and never trained;
    ``token_versions`` is the version of each response token (None: all ``policy_version``);
    ``turns`` splits the response by author: every completion has turns (given as None, it is
    one model turn, the whole response: a sample as the generator returned it); ``truncated`` says a limit
    (turns or tokens) ended the trajectory before the environment did; ``split_sequences`` are
    the other training sequences of an agent's episode (see the field).
    """

    prompt: str
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    text: str
    stop_reason: StopReason
    policy_version: int
    response_mask: list[int] | None = None
    token_versions: list[int] | None = None
    turns: list[Turn] = None  # None when built: one model turn (__post_init__)
    truncated: bool = False
    # An agent's episode split by a rewritten history (forge.agents.capture): the sequences
    # before this one, which train with its reward and advantage.
    split_sequences: "list[Completion] | None" = None
    # The reward an agent program returned for its episode: the episode's whole reward (no
    # reward function or model scores it); None: scored as usual.
    agent_reward: float | None = None

    def __post_init__(self) -> None:
        if self.turns is None:
            self.turns = [Turn("assistant", self.text, len(self.response_ids))]
        for name in ("logprobs", "response_mask", "token_versions"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.response_ids):
                raise ValueError(
                    f"a completion needs one {name} entry per response token: got {len(values)} "
                    f"for {len(self.response_ids)} tokens"
                )
        if sum(t.num_tokens for t in self.turns) != len(self.response_ids):
            raise ValueError(
                f"the turns of a completion span {sum(t.num_tokens for t in self.turns)} tokens, "
                f"its response has {len(self.response_ids)}"
            )

    @property
    def model_mask(self) -> list[int]:
        """1 on the tokens the model sampled (the ones trained), 0 on the environment's."""
        return self.response_mask if self.response_mask is not None else [1] * len(self.response_ids)

    @property
    def env_reward(self) -> float:
        """The sum of the environment's step rewards (0.0 for one turn without an environment)."""
        return sum(t.reward for t in self.turns)

    @property
    def final_answer(self) -> tuple[str, str]:
        """(context, answer) for reward functions: the model's last turn, and everything before
        it as text (the prompt, then the earlier turns). One turn: (prompt, text)."""
        last = max(i for i, t in enumerate(self.turns) if t.role == "assistant")
        return self.prompt + "".join(t.text for t in self.turns[:last]), self.turns[last].text

    @property
    def response_len(self) -> int:
        return len(self.response_ids)


@dataclass
class Episode:
    """A completion on its way to training: scored, given an advantage, and grouped.

    ``reward``, ``reward_breakdown`` (one entry per reward function and reward model),
    ``advantage`` and ``ref_logprobs`` start empty and are filled in by the reward, advantage
    and reference stages; ``reward_notes`` holds what a judge model answered, by its name. Episodes sampled from the same prompt share a ``group_id``; ``episode_id`` names
    one episode in rollout records and in the replay buffer's record of training batches.

    ``token_advantages``, when set, is the advantage of each response token (one entry per
    token; those the environment wrote are never trained, so their entries are 0): a per-token
    advantage (REINFORCE++, a teacher's signal, ``forge.rollout.token_advantages``) trains
    with it instead of ``advantage``, which then only describes the episode in records.
    ``values`` and ``returns`` (one entry per response token, with a critic): the critic's
    values of the tokens when the episode was scored, and GAE's returns, which the critic
    trains towards (0 on the environment's tokens).
    """

    completion: Completion
    target: str
    group_id: str
    reward: float = 0.0
    reward_breakdown: dict[str, float] = field(default_factory=dict)
    reward_notes: dict[str, str] = field(default_factory=dict)
    advantage: float = 0.0
    ref_logprobs: list[float] | None = None
    episode_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    token_advantages: list[float] | None = None
    values: list[float] | None = None
    returns: list[float] | None = None

    @property
    def policy_version(self) -> int:
        return self.completion.policy_version

    @property
    def prompt_len(self) -> int:
        return len(self.completion.prompt_ids)

    @property
    def response_len(self) -> int:
        return self.completion.response_len
