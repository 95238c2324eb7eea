"""An environment served by an OpenEnv server (openenv-core 0.3.0), driven through its own client.

OpenEnv environments run as HTTP/WebSocket servers (``openenv.core.env_server.create_app``).
Each trajectory opens its own WebSocket session with openenv-core's ``GenericEnvClient``; the
server gives every session its own environment instance, so concurrent trajectories never share
state. (The server's plain HTTP ``/reset`` and ``/step`` build a fresh environment per request,
so they cannot hold an episode.) A model turn's text becomes the action
``{action_field: text}``; the observation's ``observation_field`` comes back as one message with
role ``role`` (none when it is empty). A step's reward is the server's (None counts as 0.0) and
the episode ends when the server says done.

The opening messages are the row's ``"prompt"`` if it has one (a string is one user message, a
list of chat messages is used as it is) followed by the reset observation's text, which is
added to the last user message (chat templates that insist on alternating roles refuse two user
messages in a row) or is a user message of its own.

    env:
      name: forge.envs.openenv:OpenEnvEnvironment
      params: {base_url: "http://127.0.0.1:8000", action_field: message, observation_field: message}
      max_turns: 4

Params:

- ``base_url``: the server, ``http(s)://`` or ``ws(s)://`` host and port.
- ``action_field``: the action's field that gets the model's text; default ``message``.
- ``observation_field``: the observation's field shown to the model; default ``message``.
  Text is shown as it is; other values as JSON.
- ``role``: role of the environment's messages, ``user`` or ``tool``; default ``user``.
- ``reset_fields``: row keys sent to the server's ``reset`` as keyword arguments (e.g.
  ``[seed]``); the server drops those its ``reset`` does not accept. Default none.
- ``timeout_s``: seconds to wait for the server's answer to a reset or step; default 60.

The server must hold as many sessions as trajectories run at once (rows per step times
``group_size``): ``create_app(..., max_concurrent_envs=N)``, whose default is 1, and N > 1 needs
``SUPPORTS_CONCURRENT_SESSIONS = True`` on the server's environment class. Before a run starts
(``check_before_run``) that many sessions are opened at once and one of them steps once, so a
server that is down, too small, or whose fields are named otherwise is refused before training.

Needs openenv-core, installed with ``pip install --no-deps openenv-core==0.3.0`` after
``pip install -c requirements/lock.txt fastmcp``: its metadata also requires gradio (for the
server's web UI only), which conflicts with forge's pins.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from typing import Any

from forge.data.chat_prompts import check_prompt
from forge.envs.base import Environment, EnvStep, Message

try:
    from openenv.core import GenericEnvClient
    from websockets.exceptions import ConnectionClosed
except ImportError as e:
    raise ImportError(
        f"forge.envs.openenv needs openenv-core ({e}): pip install -c requirements/lock.txt fastmcp, "
        "then pip install --no-deps openenv-core==0.3.0"
    ) from e

logger = logging.getLogger(__name__)

ROLES = ("user", "tool")
URL_SCHEMES = ("http://", "https://", "ws://", "wss://")


class OpenEnvEnvironment(Environment):
    """See the module docstring."""

    def __init__(
        self,
        base_url: str,
        action_field: str = "message",
        observation_field: str = "message",
        role: str = "user",
        reset_fields: Sequence[str] = (),
        timeout_s: float = 60.0,
    ):
        if not isinstance(base_url, str) or not base_url.startswith(URL_SCHEMES):
            raise ValueError(
                f"env.params.base_url: {base_url!r} is not a server url such as 'http://127.0.0.1:8000'"
            )
        for name, value in (("action_field", action_field), ("observation_field", observation_field)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"env.params.{name}: {value!r} is not a field name")
        if role not in ROLES:
            raise ValueError(f"env.params.role: {role!r} is not one of {', '.join(ROLES)}")
        # A bare string would be taken letter by letter.
        if isinstance(reset_fields, str) or not all(isinstance(f, str) for f in reset_fields):
            raise ValueError(f"env.params.reset_fields: {reset_fields!r} is not a list of row keys")
        if timeout_s <= 0:
            raise ValueError(f"env.params.timeout_s must be positive, got {timeout_s}")
        self.base_url, self.role, self.timeout_s = base_url, role, timeout_s
        self.action_field, self.observation_field = action_field, observation_field
        self.reset_fields = list(reset_fields)
        # Opened by reset, not here: forge builds one instance at start-up only to check params.
        self._client: GenericEnvClient | None = None

    async def reset(self, row: dict) -> list[Message]:
        missing = [key for key in self.reset_fields if key not in row]
        if missing:
            raise ValueError(f"env.params.reset_fields: the row has no {missing}; its keys are {sorted(row)}")
        await self.close()
        self._client = GenericEnvClient(base_url=self.base_url, message_timeout_s=self.timeout_s)
        await self._call("connect", self._client.connect())
        logger.debug("opened a session at %s", self.base_url)
        result = await self._call("reset", self._client.reset(**{key: row[key] for key in self.reset_fields}))
        return self._opening(row, self._text(result.observation))

    async def step(self, text: str) -> EnvStep:
        if self._client is None:
            raise RuntimeError("OpenEnvEnvironment.step() before reset(): there is no session")
        result = await self._call("step", self._client.step({self.action_field: text}))
        content = self._text(result.observation)
        messages = [{"role": self.role, "content": content}] if content else []
        return EnvStep(messages, reward=float(result.reward or 0.0), done=bool(result.done))

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()  # ends the server's session; never raises

    @classmethod
    async def check_before_run(cls, params: dict[str, Any], sessions: int, row: dict) -> None:
        """Opens ``sessions`` sessions at once, each reset with ``row``, and steps one of them with
        an empty turn: the server is reachable, holds the run's sessions, takes the action field
        and answers with the observation field; raises the first failure, saying so."""
        envs = [cls(**params) for _ in range(sessions)]
        try:
            openings = await asyncio.gather(*(env.reset(row) for env in envs), return_exceptions=True)
            failed = next((o for o in openings if isinstance(o, BaseException)), None)
            if failed is None:
                try:
                    await envs[0].step("")
                except Exception as e:
                    failed = e
            if failed is not None:
                raise ValueError(
                    f"with {sessions} sessions open at once, as the run holds them: {failed}"
                ) from None
        finally:
            await asyncio.gather(*(env.close() for env in envs))

    def _opening(self, row: dict, text: str) -> list[Message]:
        messages: list[Message] = []
        if "prompt" in row:
            prompt = row["prompt"]
            check_prompt(prompt, "row['prompt']")
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if text and messages and messages[-1]["role"] == "user":
            messages[-1] = {**messages[-1], "content": f"{messages[-1]['content']}\n\n{text}"}
        elif text:
            messages.append({"role": "user", "content": text})
        if not messages:
            raise ValueError(
                f"OpenEnvEnvironment: nothing to open the conversation with: the row has no 'prompt' and "
                f"the reset observation's '{self.observation_field}' is empty"
            )
        return messages

    def _text(self, observation: dict[str, Any]) -> str:
        if self.observation_field not in observation:
            raise ValueError(
                f"env.params.observation_field: '{self.observation_field}' is not a field of the "
                f"observations of {self.base_url}, whose fields are {sorted(observation)}"
            )
        value = observation[self.observation_field]
        if value is None:
            return ""
        return value if isinstance(value, str) else json.dumps(value)

    async def _call(self, what: str, call: Any) -> Any:
        """Awaits a client call, re-raising its errors with what the user can do about them."""
        url = self.base_url
        try:
            return await call
        except ConnectionError as e:  # the client's own, when the WebSocket cannot be opened
            raise ConnectionError(
                f"env.params.base_url: cannot reach an OpenEnv server at '{url}' ({e}); start the "
                "server or fix the url"
            ) from None
        except TimeoutError:
            raise TimeoutError(
                f"the OpenEnv server at '{url}' did not answer the {what} within env.params.timeout_s="
                f"{self.timeout_s} s"
            ) from None
        except ConnectionClosed as e:
            # A server that cannot open a session (at capacity, or its environment failed to build)
            # sends the reason and closes at once: the client may only see the close.
            raise ConnectionError(
                f"the OpenEnv server at '{url}' closed this trajectory's session during the {what} ({e}). "
                "At the start of a session this means it is at capacity (it holds max_concurrent_envs "
                "sessions, default 1, and forge opens one per running trajectory) or its environment "
                "failed to build; the server's log may say which"
            ) from None
        except RuntimeError as e:  # the client's "Server error: <message> (code: <code>)"
            hint = ""
            if "CAPACITY_REACHED" in str(e):
                hint = (
                    "; start the server with max_concurrent_envs at least the number of trajectories "
                    "that run at once (its environment class needs SUPPORTS_CONCURRENT_SESSIONS = True)"
                )
            elif "VALIDATION_ERROR" in str(e) and what == "step":
                hint = (
                    f"; the action sent was {{'{self.action_field}': <the model's text>}}: is "
                    f"env.params.action_field ('{self.action_field}') the action's text field? "
                    f"GET {url}/schema lists the action's fields"
                )
            raise RuntimeError(f"the OpenEnv server at '{url}' failed the {what}: {e}{hint}") from None
