"""forge's OpenAI- and Anthropic-compatible endpoint for agents: an HTTP server on this host, in
the caller's event loop, that answers each episode's calls with the policy and captures them
(`forge.agents.capture`).

Every episode has an address of its own, ``/episodes/<id>``: an agent's ``openai.AsyncOpenAI``
gets ``<address>/v1`` as its base URL (``anthropic.AsyncAnthropic``: the address itself), so
episodes running at once never mix, and nothing else identifies them. Under ``/v1``:
``POST /chat/completions`` and ``POST /completions`` (`forge.agents.openai_api` says what a
request may ask),
``POST /messages`` (Anthropic's, `forge.agents.anthropic_api`) and ``GET /models``.

Each episode samples through its own ``generate`` (the rollouts' generate call,
`forge.rollout.groups.Generate`, bound to the rollout's policy version) with its own allowed
settings (the loss's temperature in training, greedy in the eval); its k-th call is seeded by
(the episode's key, k), so a run in sync mode samples the same tokens every time. The calls of
a rollout's episodes reach the generator in batches, turn by turn (`forge.agents.batching`). A call may
sample up to the token budget of a training sequence (``max_sequence_tokens``, the trainer's
``seq_len``), its ``max_tokens`` cut to what is left; a conversation that has used it all is
refused with OpenAI's ``context_length_exceeded``, as is a call past the episode's ``max_calls``.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from forge.agents.anthropic_api import error_body as anthropic_error
from forge.agents.anthropic_api import message_response, parse_messages_request
from forge.agents.batching import CallBatcher
from forge.agents.capture import EpisodeCapture
from forge.agents.openai_api import (
    AgentSampling,
    ChatRequest,
    RefusedRequest,
    chat_completion,
    models_list,
    parse_chat_request,
    parse_completion_request,
    reply_message,
    text_completion,
)
from forge.engines.generation import sample_seed
from forge.envs.turns import TurnRenderer
from forge.rollout.groups import Generate


@dataclass
class AgentEpisode:
    """One episode's address, how it samples, and what its calls sampled."""

    id: str
    key: int
    base_url: str
    capture: EpisodeCapture
    generate: Generate
    allowed: AgentSampling


class AgentEndpoint:
    """The endpoint of a run's agent episodes (see the module docstring); `model` is the name
    `/models` lists and responses carry."""

    def __init__(
        self,
        renderer: TurnRenderer,
        max_sequence_tokens: int | None = None,
        max_calls: int | None = None,
        model: str = "policy",
    ):
        self.renderer, self.model = renderer, model
        self.max_sequence_tokens, self.max_calls = max_sequence_tokens, max_calls
        self._episodes: dict[str, AgentEpisode] = {}
        # Open episodes per rollout (its generate call): the batcher waits for each one's call.
        self._open: Counter = Counter()
        self._batcher = CallBatcher(lambda generate: self._open[generate])
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Serves on `host`:`port` (0: a free port, read back into `url`)."""
        app = web.Application()
        app.router.add_post("/episodes/{episode}/v1/chat/completions", self._chat)
        app.router.add_get("/episodes/{episode}/v1/models", self._models)
        app.router.add_post("/episodes/{episode}/v1/messages", self._messages)
        app.router.add_post("/episodes/{episode}/v1/completions", self._completions)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        # A rollout's episodes connect at once: a listen backlog for all of them.
        await web.TCPSite(self._runner, host, port, backlog=4096).start()
        self.url = f"http://{host}:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, key: int, generate: Generate, allowed: AgentSampling) -> AgentEpisode:
        """A new episode that samples with `generate` as `allowed`, its calls seeded from `key`."""
        episode_id = uuid.uuid4().hex
        address = f"{self.url}/episodes/{episode_id}/v1"
        episode = AgentEpisode(episode_id, key, address, EpisodeCapture(self.renderer), generate, allowed)
        self._episodes[episode_id] = episode
        self._open[generate] += 1
        return episode

    def close(self, episode: AgentEpisode) -> EpisodeCapture:
        """Ends `episode`: later calls to its address are refused. Its capture."""
        if self._episodes.pop(episode.id, None) is not None:
            self._open[episode.generate] -= 1
            if not self._open[episode.generate]:
                del self._open[episode.generate]
            self._batcher.changed(episode.generate)
        return episode.capture

    def _episode(self, request: web.Request) -> AgentEpisode:
        episode = self._episodes.get(request.match_info["episode"])
        if episode is None:
            refused = RefusedRequest("no such episode (it ended, or the URL is not one forge gave)")
            raise web.HTTPNotFound(text=json.dumps(refused.body()), content_type="application/json")
        return episode

    async def _models(self, request: web.Request) -> web.Response:
        self._episode(request)
        return web.json_response(models_list(self.model))

    async def _chat(self, request: web.Request) -> web.Response:
        return await self._openai_call(
            request,
            parse_chat_request,
            lambda chat, call, samples, replies: chat_completion(
                self.model, call.ids, samples, replies, self.renderer.tokenizer, chat.logprobs
            ),
        )

    async def _completions(self, request: web.Request) -> web.Response:
        return await self._openai_call(
            request,
            parse_completion_request,
            lambda text, call, samples, _: text_completion(
                self.model, call.ids, samples, self.renderer.tokenizer, text.logprobs
            ),
        )

    async def _openai_call(self, request: web.Request, parse, respond) -> web.Response:
        """An OpenAI API call: `parse` reads the request, `respond` makes the response object
        of its samples; a refusal is OpenAI's error shape."""
        episode = self._episode(request)
        try:
            chat = parse(await _body(request), episode.allowed)
            call, samples, replies = await self._sample(episode, chat)
        except RefusedRequest as e:
            return web.json_response(e.body(), status=400)
        return web.json_response(respond(chat, call, samples, replies))

    async def _messages(self, request: web.Request) -> web.Response:
        episode = self._episode(request)
        try:
            chat = parse_messages_request(await _body(request), episode.allowed)
            call, [sample], [reply] = await self._sample(episode, chat)
        except RefusedRequest as e:
            return web.json_response(anthropic_error(e), status=400)
        return web.json_response(message_response(self.model, call.ids, sample, reply, chat.stop))

    async def _sample(self, episode: AgentEpisode, chat: ChatRequest):
        """The call's prompt (captured), its samples, and the chat reply each becomes."""
        if self.max_calls is not None and episode.capture.calls >= self.max_calls:
            raise RefusedRequest(
                f"this episode made its {self.max_calls} calls (agent.max_calls): end it", code="max_calls"
            )
        if chat.prompt is not None:
            call = episode.capture.prompt_text(chat.prompt)
        else:
            try:
                call = episode.capture.prompt(chat.messages, chat.tools)
            except ValueError as e:  # messages the chat template cannot render
                raise RefusedRequest(str(e), "messages") from e
        max_tokens = self._room(len(call.ids), chat.max_tokens)
        samples = await self._batcher.sample(
            episode.generate,
            call.ids,
            sample_seed(episode.key, episode.capture.calls),
            n=chat.n,
            max_tokens=max_tokens,
            temperature=episode.allowed.temperature,
            stop=chat.stop,
        )
        replies = [reply_message(sample, chat.tools) for sample in samples]
        episode.capture.sampled(call, samples, [message for message, _ in replies])
        return call, samples, replies

    def _room(self, prompt_tokens: int, max_tokens: int) -> int:
        """`max_tokens`, cut to what the sequence budget leaves after the prompt."""
        if self.max_sequence_tokens is None:
            return max_tokens
        left = self.max_sequence_tokens - prompt_tokens
        if left <= 0:
            raise RefusedRequest(
                f"the conversation holds {prompt_tokens} tokens, and a training sequence of this run holds "
                f"{self.max_sequence_tokens} (trainer.engine.training.seq_len): end the episode",
                "messages",
                code="context_length_exceeded",
            )
        return min(max_tokens, left)


async def _body(request: web.Request) -> Any:
    """The request's JSON (None if it is none); a dropped connection ends the call."""
    try:
        return await request.json()
    except ValueError:
        return None
    except ConnectionResetError:  # the agent gave up on the call (its episode was cancelled)
        raise web.HTTPClientError(reason="connection lost") from None
