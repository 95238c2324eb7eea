"""Token-faithful capture: one agent episode's chat calls as the exact token sequences the
trainer trains on.

An agent sends its whole conversation at every call. Rendering that conversation again with the
chat template would not give back the tokens the model sampled (a template may drop past
reasoning; the decoded text may tokenize differently), so the capture never re-renders what was
sampled:

- a call whose messages extend what an earlier call ended with (that call's messages, then the
  assistant message it returned) continues that call's sequence: the sampled ids stay as they
  were, and only the new messages are rendered, as the chat template places them after an
  assistant turn (`forge.envs.turns.TurnRenderer`), not trained (mask 0);
- any other call (the agent dropped, edited or summarised earlier turns, or changed its tools)
  starts a new sequence from its messages rendered whole. The episode is then split into
  several sequences, each exact, counted in ``splits``.

A call with ``n`` samples forks its sequence: each sample ends a sequence of its own, which a
later call may continue. Every sequence that holds a sample is trained, with the episode's reward.

A /completions call (a text prompt, `prompt_text`) goes the same way by text: one whose text
extends an earlier call's text and sample continues that sequence with the rest tokenized.

``retokenized`` counts the sequences whose tokens differ from their conversation rendered whole:
the tokens a capture by re-rendering would have trained on instead of the sampled ones.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from forge.data.chat_prompts import Message, RenderedPrompt
from forge.data.types import Completion
from forge.envs.turns import TurnRenderer
from forge.rollout.trajectories import Trajectory


def message_key(message: dict[str, Any]) -> tuple:
    """What identifies a message when an agent sends it back: its role, its text (the text parts
    of a list content, joined) and its tool calls (name and arguments, as JSON with sorted keys)."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    calls = tuple(
        (call["function"]["name"], _canonical_arguments(call["function"].get("arguments", "{}")))
        for call in message.get("tool_calls") or ()
    )
    return message["role"], content or "", calls


def _canonical_arguments(arguments: str | dict) -> str:
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return arguments
    return json.dumps(value, sort_keys=True)


@dataclass
class _Sequence:
    trajectory: Trajectory
    # The conversation the sequence holds (as the chat template reads it), up to its last
    # sample's reply, and the tools declared to it (as JSON).
    messages: list[Message] = field(default_factory=list)
    tools: list[dict] | None = None
    # A /completions sequence: its text so far (prompt and samples), instead of messages.
    text: str | None = None

    @property
    def history(self) -> list[tuple]:
        return [message_key(m) for m in self.messages]


@dataclass
class PendingCall:
    """A call's prompt, to be sampled from: ``ids`` for the generator."""

    ids: list[int]
    sequence: _Sequence
    messages: list[Message]
    text: str | None = None


class EpisodeCapture:
    """The token sequences of one agent episode, call by call (see the module docstring)."""

    def __init__(self, renderer: TurnRenderer):
        self.renderer = renderer
        self._sequences: list[_Sequence] = []
        self.calls = 0
        self.splits = 0

    def prompt(self, messages: list[Message], tools: list[dict] | None = None) -> PendingCall:
        """The prompt of a call with `messages` (and `tools` declared): an earlier sequence
        continued with the new messages' ids, or a new sequence."""
        self.calls += 1
        plain = [_plain(m) for m in messages]
        extended = self._extended(plain, tools)
        if extended is not None:
            trajectory = copy.deepcopy(extended.trajectory)
            new = plain[len(extended.messages) :]
            last_turn = trajectory.response_ids[-trajectory.turns[-1].num_tokens :]
            trajectory.add_environment_turn(new[0]["role"], self.renderer.environment_ids(new, last_turn))
        else:
            if self._sequences:
                self.splits += 1
            trajectory = Trajectory(self.renderer.prompts.render(plain, tools))
        return PendingCall(trajectory.ids, _Sequence(trajectory, plain, tools), plain)

    def prompt_text(self, text: str) -> PendingCall:
        """The prompt of a /completions call: the sequence whose text `text` goes on from,
        continued with the rest of it tokenized (mask 0), or a new sequence of `text` tokenized."""
        self.calls += 1
        tokenizer = self.renderer.tokenizer
        extended = max(
            (
                s
                for s in self._sequences
                if s.text is not None and len(text) > len(s.text) and text.startswith(s.text)
            ),
            key=lambda s: len(s.text),
            default=None,
        )
        if extended is not None:
            trajectory = copy.deepcopy(extended.trajectory)
            rest = tokenizer.encode(text[len(extended.text) :], add_special_tokens=False)
            trajectory.add_environment_turn("user", rest)
        else:
            if self._sequences:
                self.splits += 1
            trajectory = Trajectory(RenderedPrompt(tokenizer(text).input_ids, text))
        return PendingCall(trajectory.ids, _Sequence(trajectory, text=text), [], text)

    def sampled(self, call: PendingCall, samples: list[Completion], replies: list[dict[str, Any]]) -> None:
        """Records the samples of `call` (what the generator returned for its prompt) and the
        assistant message each became for the agent; each ends a sequence."""
        for sample, reply in zip(samples, replies, strict=True):
            trajectory = copy.deepcopy(call.sequence.trajectory)
            trajectory.add_model_turn(sample)
            if call.text is not None:
                self._sequences.append(_Sequence(trajectory, text=call.text + sample.text))
            else:
                messages = [*call.messages, _plain(reply)]
                self._sequences.append(_Sequence(trajectory, messages, call.sequence.tools))

    def _extended(self, messages: list[Message], tools: list[dict] | None) -> _Sequence | None:
        """The sequence whose conversation `messages` goes on from, the longest (then the latest)."""
        keys = [message_key(m) for m in messages]
        best = None
        for sequence in self._sequences:
            n = len(sequence.messages)
            if sequence.text is not None:
                continue
            if sequence.tools == tools and len(keys) > n and keys[:n] == sequence.history:
                if best is None or n >= len(best.messages):
                    best = sequence
        return best

    def sequences(self) -> list[Trajectory]:
        """The episode's training sequences: every sequence not continued by a later call (a
        continued one is a prefix of its continuation)."""
        return [sequence.trajectory for sequence in self._leaves()]

    def _leaves(self) -> list[_Sequence]:
        return [
            s for s in self._sequences if not any(o is not s and _continues(o, s) for o in self._sequences)
        ]

    def retokenized(self) -> int:
        """How many of `sequences()` differ from their conversation rendered whole (anything the
        template adds after the last reply aside)."""
        count = 0
        for sequence in self._leaves():
            ids = sequence.trajectory.ids
            if sequence.text is not None:
                whole = self.renderer.tokenizer(sequence.text).input_ids
            else:
                whole = self.renderer.prompts.apply(
                    sequence.messages, tokenize=True, tools=sequence.tools, add_generation_prompt=False
                )
            count += whole[: len(ids)] != ids
        return count


def _continues(later: _Sequence, earlier: _Sequence) -> bool:
    ids = earlier.trajectory.ids
    if later.trajectory.ids[: len(ids)] != ids or len(later.trajectory.ids) == len(ids):
        return False
    if earlier.text is not None or later.text is not None:
        return earlier.text is not None and later.text is not None and later.text.startswith(earlier.text)
    n = len(earlier.messages)
    return len(later.messages) > n and later.history[:n] == earlier.history


def _plain(message: dict[str, Any]) -> Message:
    """A message as the chat template reads it: role and text content (and tool calls)."""
    role, content, calls = message_key(message)
    plain: dict[str, Any] = {"role": role, "content": content}
    if calls:
        plain["tool_calls"] = [
            {"type": "function", "function": {"name": name, "arguments": json.loads(arguments)}}
            for name, arguments in calls
        ]
    return plain
