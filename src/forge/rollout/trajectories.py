"""One trajectory's token sequence as it grows: the opening prompt, then model turns and
environment turns alternating. It becomes a ``Completion`` whose response is everything after
the opening prompt (see ``forge.data.types.Completion``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from forge.data.chat_prompts import RenderedPrompt
from forge.data.types import Completion, StopReason, Turn


@dataclass
class Trajectory:
    prompt: RenderedPrompt
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    stop_reason: StopReason = "stop"
    done: bool = False
    truncated: bool = False
    error: str | None = None  # the environment failed: the trajectory (and its group) is lost
    last_model_text: str = ""  # the latest model turn, decoded: what the environment reads

    @property
    def ids(self) -> list[int]:
        """The whole sequence so far: what the next model turn continues from."""
        return self.prompt.ids + self.response_ids

    @property
    def model_turns(self) -> int:
        return sum(t.role == "assistant" for t in self.turns)

    def add_model_turn(self, turn: Completion) -> None:
        """Appends a sampled turn as it is: its ids, logprobs and version, trained (mask 1)."""
        n = len(turn.response_ids)
        self.response_ids += turn.response_ids
        self.logprobs += turn.logprobs
        self.mask += [1] * n
        self.versions += turn.token_versions or [turn.policy_version] * n
        self.turns.append(Turn("assistant", "", n))  # texts: see to_completion
        self.stop_reason = turn.stop_reason
        self.last_model_text = turn.text

    def reward_last_turn(self, reward: float) -> None:
        self.turns[-1].reward += reward

    def add_environment_turn(self, role: str, ids: list[int]) -> None:
        """Appends the environment's ids: read by the model, not trained (mask 0, logprob 0.0);
        they carry the version of the model turn before them."""
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.versions += [self.versions[-1]] * len(ids)
        self.turns.append(Turn(role, "", len(ids)))

    def cut(self, length: int) -> None:
        """Drops the tokens past ``length`` of the whole sequence (a token budget), and marks the
        trajectory truncated."""
        keep = length - len(self.prompt.ids)
        drop = len(self.response_ids) - keep
        if drop <= 0:
            return
        self.response_ids, self.logprobs = self.response_ids[:keep], self.logprobs[:keep]
        self.mask, self.versions = self.mask[:keep], self.versions[:keep]
        while drop:
            last = self.turns[-1]
            if last.num_tokens <= drop:
                drop -= last.num_tokens
                self.turns.pop()
            else:
                last.num_tokens -= drop
                drop = 0
        self.truncated, self.done, self.stop_reason = True, True, "length"

    def to_completion(self, tokenizer) -> Completion:
        """The trajectory as one ``Completion``, with its turns. Its mask and token versions are
        None where they say nothing (every token the model's, every token one version), as in the
        generator's samples: a one-turn trajectory is exactly the sample it took, as its one turn."""
        text = tokenizer.decode(self.response_ids, skip_special_tokens=True)
        start = 0
        for turn in self.turns:  # each turn's text is its own tokens, decoded like `text`
            turn.text = tokenizer.decode(
                self.response_ids[start : start + turn.num_tokens], skip_special_tokens=True
            )
            start += turn.num_tokens
        return Completion(
            prompt=self.prompt.text,
            prompt_ids=list(self.prompt.ids),
            response_ids=self.response_ids,
            logprobs=self.logprobs,
            text=text,
            stop_reason=self.stop_reason,
            policy_version=min(self.versions) if self.versions else 0,
            response_mask=self.mask if 0 in self.mask else None,
            token_versions=self.versions if len(set(self.versions)) > 1 else None,
            turns=self.turns,
            truncated=self.truncated,
        )
