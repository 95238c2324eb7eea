"""Remote rewards: a reward server scores responses over HTTP (a judge model, a sandbox, a
service another team runs), configured as ``reward.remote``.

The protocol: each batch of at most ``batch_size`` responses is one POST to ``url`` of JSON
``{"items": [{"prompt": ..., "response": ..., "target": ...}, ...]}``, answered with status 200
and JSON ``{"scores": [...]}``: one finite number per item, in order (other keys are ignored).
A rollout's batches are sent ``max_concurrent`` at a time, in threads, while the reward
functions run, so a rollout waits for its slowest round of batches, not for their sum.

A request fails when it gets no answer within ``timeout_s`` (to connect, and between bytes of
the answer), cannot reach the server, or is answered with status 5xx, 408 or 429: these are
sent again, up to ``retries`` times, after a backoff of ``retry_backoff_s`` that doubles each
time (each counted in ``reward/remote/retries``). An answer that breaks the protocol (another
status, not JSON, a wrong number of scores, a score that is not a finite number) is not sent
again: the server would answer the same. The items of a batch whose last request failed score
``reward.error_reward`` and the batch counts once, as every failed scoring call does (a
`Failure`, applied by the rollout's scorer, `forge.rewards.sources`): in
``reward/remote/timeouts`` when that request timed out, else in ``reward/remote/errors``. A
batch that a retry scored is no failure. The run goes on. So one batch takes at most about
``(retries + 1) * timeout_s`` plus the backoffs.

Only the standard library: urllib in a thread pool is all a few requests per rollout need.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from pydantic import Field, field_validator

from forge.config import ForgeConfigModel
from forge.observability import Reduce, record_metric
from forge.rewards.failures import Failure

logger = logging.getLogger(__name__)

# The reward server's name in each response's reward breakdown and in metric keys (reward/remote).
REMOTE = "remote"
# Statuses that say "not now" rather than "never": the request is sent again.
RETRY_STATUSES = {408, 429}
# An answer that breaks the protocol is quoted in the log up to this length.
QUOTED_CHARS = 200


class RemoteRewardConfig(ForgeConfigModel):
    # The server's scoring endpoint, e.g. http://127.0.0.1:8000/score (see the module docstring).
    url: str
    weight: float = 1.0
    # Responses per request.
    batch_size: int = Field(32, ge=1)
    # How long the server may leave a request without an answer (to connect, and between bytes).
    timeout_s: float = Field(30.0, gt=0)
    # Times a request that timed out, could not connect or got a 5xx, 408 or 429 is sent again.
    retries: int = Field(2, ge=0)
    # The wait before the first retry; it doubles with each retry of the same batch.
    retry_backoff_s: float = Field(0.5, ge=0)
    # Requests in flight at once (threads of the reward actor).
    max_concurrent: int = Field(8, ge=1)

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            # The config loader names the key and the value.
            raise ValueError(
                "must be an http:// or https:// URL with a host: the reward server's scoring "
                "endpoint, e.g. http://127.0.0.1:8000/score"
            )
        return url


class RequestFailed(Exception):
    def __init__(self, counter: str, why: str, retryable: bool):
        super().__init__(why)
        self.counter = counter  # "errors" or "timeouts": the metric it is counted in
        self.why = why
        self.retryable = retryable


@dataclass
class PendingScores:
    """The scores of items submitted to the reward server, batch by batch as they come."""

    batches: list[Future]

    def result(self) -> list[float | Failure]:
        """Every item's score, in order, or its batch's `Failure` (waits for the batches still in
        flight)."""
        return [score for batch in self.batches for score in batch.result()]


class RemoteScorer:
    """Scores (prompt, response, target) items with the reward server (see the module docstring);
    the items of a batch that failed for good get one `Failure`."""

    def __init__(self, cfg: RemoteRewardConfig):
        self.cfg = cfg
        self._pool = ThreadPoolExecutor(cfg.max_concurrent, thread_name_prefix="remote-reward")

    def submit(self, items: list[tuple[str, str, str]]) -> PendingScores:
        """Starts scoring `items` in batches of `batch_size`; returns at once."""
        size = self.cfg.batch_size
        return PendingScores(
            [self._pool.submit(self._score_batch, items[i : i + size]) for i in range(0, len(items), size)]
        )

    def check(self, item: tuple[str, str, str]) -> None:
        """One request of one item, not sent again: a server that is down, or answers otherwise
        than the protocol says, is refused naming reward.remote.url (checked before a run)."""
        try:
            self._post(request_body([item]), 1)
        except RequestFailed as failure:
            raise ValueError(
                f"reward.remote.url: the reward server at {self.cfg.url} {failure.why} when asked to score "
                "one response before the run: start it, or fix reward.remote.url (the protocol: "
                "forge.rewards.remote)"
            ) from None

    def close(self) -> None:
        """Stops sending: batches not started yet are dropped, requests in flight end on their own."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _score_batch(self, items: list[tuple[str, str, str]]) -> list[float | Failure]:
        body = request_body(items)
        attempt = 0
        while True:
            attempt += 1
            try:
                return self._post(body, len(items))
            except RequestFailed as failure:
                what = (
                    f"reward server {self.cfg.url}: a batch of {len(items)} responses {failure.why} "
                    f"(attempt {attempt} of {self.cfg.retries + 1})"
                )
                if not (failure.retryable and attempt <= self.cfg.retries):
                    return [Failure(failure.counter, what)] * len(items)
                logger.warning("%s; sending it again", what)
            record_metric(f"reward/{REMOTE}/retries", 1, Reduce.SUM)
            time.sleep(self.cfg.retry_backoff_s * 2 ** (attempt - 1))

    def _post(self, body: bytes, size: int) -> list[float]:
        request = urllib.request.Request(
            self.cfg.url, data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.cfg.timeout_s) as answer:
                text = answer.read()
        except urllib.error.HTTPError as e:
            e.close()
            retryable = e.code >= 500 or e.code in RETRY_STATUSES
            raise RequestFailed("errors", f"was answered HTTP {e.code} {e.reason}", retryable) from None
        except (OSError, http.client.HTTPException) as e:  # URLError is an OSError
            reason = e.reason if isinstance(e, urllib.error.URLError) else e
            if isinstance(reason, TimeoutError):
                why = f"got no answer within {self.cfg.timeout_s:g} s (reward.remote.timeout_s)"
                raise RequestFailed("timeouts", why, retryable=True) from None
            raise RequestFailed("errors", f"failed: {reason!r}", retryable=True) from None
        return parse_scores(text, size)


def request_body(items: list[tuple[str, str, str]]) -> bytes:
    """The JSON of one request: ``{"items": [{"prompt", "response", "target"}, ...]}``."""
    return json.dumps({"items": [{"prompt": p, "response": r, "target": t} for p, r, t in items]}).encode()


def parse_scores(text: bytes, size: int) -> list[float]:
    """The scores of an answer to a batch of `size` items, or `RequestFailed` (not retryable)."""
    try:
        scores = json.loads(text)["scores"]
    except (ValueError, TypeError, KeyError):  # not JSON, not an object, no "scores"
        scores = None
    if not isinstance(scores, list):
        raise RequestFailed("errors", f'answered {text[:QUOTED_CHARS]!r}, not {{"scores": [...]}}', False)
    if len(scores) != size:
        raise RequestFailed("errors", f"answered {len(scores)} scores for {size} items", False)
    for position, score in enumerate(scores):
        if not is_finite_number(score):
            why = f"answered {str(score)[:QUOTED_CHARS]!r} at position {position}, not a finite number"
            raise RequestFailed("errors", why, False)
    return [float(score) for score in scores]


def is_finite_number(value) -> bool:
    # JSON true/false load as bools, which are ints to Python; a huge integer overflows a float.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False
