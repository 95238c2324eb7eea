"""Remote rewards against a real HTTP server on 127.0.0.1 that this test starts: responses go in
batches of batch_size, several at once; retries are counted, and a batch that fails for good
scores error_reward, counts once (a timeout or an error) and the next is scored; the reward actor weighs the server
in with reward functions and group functions."""

import asyncio
import json
import socket
import threading
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from pydantic import ValidationError
from scoring import Scored, one_turn

from forge.actors.reward import RewardActor, RewardConfig
from forge.controller import shutdown
from forge.observability.collector import pop_state
from forge.rewards.remote import RemoteRewardConfig
from forge.rewards.scorer import RewardScorer
from forge.rewards.sources import RewardFunctions, RolloutScorer
from forge.runs.checks import check_reward_server

# A request of the server's rendezvous waits at most this long for the others.
RENDEZVOUS_S = 5.0


class RewardServer:
    """Scores each response len(response) % 3. `plan` holds how it treats its next requests
    ("hang", "500", "404", "wrong_length", "not_json", "nan"; then it answers right);
    `rendezvous` = n holds each request until n have arrived, to see them sent at once."""

    def __init__(self):
        self.batches: list[int] = []  # items of each request, as they arrived
        self.plan: deque[str] = deque()
        self.rendezvous = 1
        self.in_flight = self.max_in_flight = 0
        self._arrived = threading.Condition()
        self._release = threading.Event()  # ends the hung requests at close
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._httpd.server_port}/score"
        threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self._release.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["items"]
                with server._arrived:
                    server.batches.append(len(items))
                    how = server.plan.popleft() if server.plan else "right"
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                    server._arrived.notify_all()
                    server._arrived.wait_for(lambda: len(server.batches) >= server.rendezvous, RENDEZVOUS_S)
                try:
                    self.answer(how, [len(item["response"]) % 3 for item in items])
                finally:
                    with server._arrived:
                        server.in_flight -= 1

            def answer(self, how: str, scores: list[float]) -> None:
                if how == "hang":
                    server._release.wait()
                    return
                if how in ("500", "404"):
                    self.send_error(int(how))
                    return
                if how == "wrong_length":
                    scores = scores[1:]
                if how == "nan":
                    scores[0] = float("nan")  # json writes NaN, which is no finite number
                body = b"<html>busy</html>" if how == "not_json" else json.dumps({"scores": scores}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # keeps the test's output quiet
                pass

        return Handler


@pytest.fixture
def server():
    server = RewardServer()
    yield server
    server.close()


def remote_scorer(server: RewardServer, error_reward: float = -1.0, **remote) -> Scored:
    config = RemoteRewardConfig(url=server.url, **{"retry_backoff_s": 0.01, **remote})
    return Scored(RewardScorer([], remote=config), error_reward)


def remote_scores(scorer: Scored, responses: list[str]) -> list[float]:
    [group] = scorer.score_groups([["p"] * len(responses)], [responses], ["t"])
    return [breakdown["remote"] for _, breakdown in group]


@pytest.mark.parametrize(
    ("remote", "message"),
    [
        ({"url": "ftp://127.0.0.1/score"}, "must be an http:// or https:// URL with a host"),
        ({"url": "127.0.0.1:8000/score"}, "must be an http:// or https:// URL with a host"),
        ({"url": "http:///score"}, "must be an http:// or https:// URL with a host"),
        ({"url": "http://127.0.0.1/score", "batch_size": 0}, "batch_size"),
        ({"url": "http://127.0.0.1/score", "timeout_s": 0}, "timeout_s"),
        ({"url": "http://127.0.0.1/score", "retries": -1}, "retries"),
        ({"url": "http://127.0.0.1/score", "max_concurrent": 0}, "max_concurrent"),
        ({"url": "http://127.0.0.1/score", "retry": 3}, "retry"),
    ],
)
def test_the_config_refuses_bad_values_naming_the_key(remote, message):
    with pytest.raises(ValidationError, match=message) as refused:
        RewardConfig.model_validate({"remote": remote})
    assert "remote." in str(refused.value)


def test_responses_go_in_batches_of_batch_size_and_are_weighed_with_the_functions(server):
    pop_state()
    remote = RemoteRewardConfig(url=server.url, batch_size=4, weight=2.0)
    scorer = Scored(RewardScorer([("toy_task", 1.0)], remote=remote))
    try:
        responses = [["2", "22", "x", "2", "222"], ["7", "77", "777", "7", "<answer>7</answer>"]]
        scores = scorer.score_groups([["1+1="] * 5, ["3+4="] * 5], responses, ["2", "7"])
    finally:
        scorer.close()
    assert sorted(server.batches) == [2, 4, 4]  # 10 responses, one rollout
    breakdowns = [breakdown for group in scores for _, breakdown in group]
    assert [b["remote"] for b in breakdowns] == [len(r) % 3 for group in responses for r in group]
    assert [total for group in scores for total, _ in group] == [
        b["toy_task"] + 2 * b["remote"] for b in breakdowns
    ]
    state = pop_state()
    assert state["reward/remote"].value() == pytest.approx(sum(b["remote"] for b in breakdowns) / 10)
    assert not any(key.startswith("reward/remote/") for key in state)
    assert scorer.counts == {"errors": 0, "timeouts": 0}


def test_batches_are_sent_at_once_up_to_max_concurrent(server):
    # Each request waits for a second one: sent one after another, each would wait RENDEZVOUS_S.
    server.rendezvous = 2
    scorer = remote_scorer(server, batch_size=3, max_concurrent=2)
    try:
        assert remote_scores(scorer, ["a" * n for n in range(12)]) == [n % 3 for n in range(12)]
    finally:
        scorer.close()
    assert server.batches == [3, 3, 3, 3]
    assert server.max_in_flight == 2


def test_a_request_that_times_out_or_fails_is_sent_again_and_a_batch_a_retry_scored_is_no_failure(server):
    pop_state()
    server.plan.extend(["500", "hang"])
    scorer = remote_scorer(server, timeout_s=0.5, retries=2)
    try:
        assert remote_scores(scorer, ["a", "bb", "ccc"]) == [1, 2, 0]
        state = pop_state()
        assert state["reward/remote/retries"].value() == 2
        assert "reward/remote/errors" not in state and "reward/remote/timeouts" not in state
        assert scorer.counts == {"errors": 0, "timeouts": 0}
        assert server.batches == [3, 3, 3]
    finally:
        scorer.close()


def test_a_batch_that_fails_after_its_retries_scores_error_reward_and_the_next_is_scored(server):
    pop_state()
    server.plan.extend(["hang", "hang"])
    scorer = remote_scorer(server, timeout_s=0.3, retries=1, batch_size=2)
    try:
        scores = remote_scores(scorer, ["a", "bb"])
        assert scores == [-1.0, -1.0]
        state = pop_state()
        # The batch counts once, as its last request failed: a timeout.
        assert state["reward/remote/timeouts"].value() == 1 and state["reward/remote/retries"].value() == 1
        assert scorer.counts == {"errors": 0, "timeouts": 1}
        assert remote_scores(scorer, ["a", "bb"]) == [1, 2]  # the run goes on
    finally:
        scorer.close()


@pytest.mark.parametrize("how", ["wrong_length", "not_json", "nan", "404"])
def test_an_answer_that_breaks_the_protocol_scores_error_reward_and_is_not_sent_again(server, how):
    pop_state()
    server.plan.append(how)
    scorer = remote_scorer(server, error_reward=-1.0, retries=3, batch_size=2)
    try:
        assert remote_scores(scorer, ["a", "bb", "ccc"]) in ([-1.0, -1.0, 0], [1, 2, -1.0])
        assert pop_state()["reward/remote/errors"].value() == 1
        assert scorer.counts == {"errors": 1, "timeouts": 0}
    finally:
        scorer.close()
    assert sorted(server.batches) == [1, 2]


def test_an_unreachable_server_scores_error_reward_after_the_retries():
    with socket.socket() as free:  # a port nothing listens on once the socket is closed
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    pop_state()
    remote = RemoteRewardConfig(url=f"http://127.0.0.1:{port}/score", retries=2, retry_backoff_s=0.01)
    scorer = Scored(RewardScorer([], remote=remote), -1.0)
    try:
        assert remote_scores(scorer, ["a", "bb"]) == [-1.0, -1.0]
        state = pop_state()
        assert state["reward/remote/errors"].value() == 1 and state["reward/remote/retries"].value() == 2
    finally:
        scorer.close()


def test_the_reward_actor_scores_with_functions_a_group_function_and_the_server_together(server):
    distinct = "forge.rewards.group_functions:distinct_in_group"
    config = RewardConfig(
        functions=[{"name": "toy_task"}, {"name": distinct, "weight": 0.5}],
        remote={"url": server.url, "batch_size": 3, "timeout_s": 0.5, "retries": 0},
    )
    responses = [["2", "2", "22"], ["7", "1", "77", "x"]]

    async def run():
        reward = await RewardActor.as_actor(config)
        # As a run scores: the reward actor's values, weighed and their failures applied here.
        scorer = RolloutScorer(
            [RewardFunctions.of(config, reward.evaluate_groups.route)], config.error_reward
        )
        try:
            groups = [
                [one_turn(prompt, r) for r in group]
                for prompt, group in zip(["1+1=", "3+4="], responses, strict=True)
            ]
            scores = await scorer.score(groups, ["2", "7"])
            server.plan.append("hang")
            # One request of two responses hangs: one Failure for both, from the reward actor.
            failed = await scorer.score([[one_turn("1+1=", "2"), one_turn("1+1=", "2")]], ["2"])
            return scores, failed, scorer.counts
        finally:
            await shutdown()

    scores, failed, counts = asyncio.run(run())
    assert [[breakdown for _, breakdown, _ in group] for group in scores] == [
        [
            {"toy_task": 1.0, distinct: 0.5, "remote": 1},
            {"toy_task": 1.0, distinct: 0.5, "remote": 1},
            {"toy_task": 0.1, distinct: 1.0, "remote": 2},
        ],
        [
            {"toy_task": 1.0, distinct: 1.0, "remote": 1},
            {"toy_task": 0.1, distinct: 1.0, "remote": 1},
            {"toy_task": 0.1, distinct: 1.0, "remote": 2},
            {"toy_task": 0.0, distinct: 1.0, "remote": 1},
        ],
    ]
    assert [total for total, _, _ in scores[0]] == [1.0 + 0.25 + 1, 1.0 + 0.25 + 1, 0.1 + 0.5 + 2]
    assert sorted(server.batches[:3]) == [1, 3, 3]  # 7 responses of one rollout, in 3 requests
    assert failed == [[(1.0 + 0.25 + 0.0, {"toy_task": 1.0, distinct: 0.5, "remote": 0.0}, {})] * 2]
    assert counts == {"errors": 0, "timeouts": 1}  # counted once


@pytest.mark.parametrize("how", ["right", "404", "not_json", "down"])
def test_the_check_before_a_run_refuses_a_server_that_is_down_or_breaks_the_protocol(server, how):
    row = {"prompt": "1+1=", "target": "2"}
    if how == "down":
        server.close()
    elif how != "right":
        server.plan.append(how)
    remote = RemoteRewardConfig(url=server.url, retries=3)
    if how == "right":
        check_reward_server(remote, row)
        assert server.batches == [1]  # one request of one response
        return
    with pytest.raises(ValueError) as refused:
        check_reward_server(remote, row)
    assert str(refused.value).startswith(f"reward.remote.url: the reward server at {server.url} ")
    assert {"404": "HTTP 404", "not_json": 'not {"scores"', "down": "failed"}[how] in str(refused.value)
    assert len(server.batches) == (0 if how == "down" else 1)  # not sent again
