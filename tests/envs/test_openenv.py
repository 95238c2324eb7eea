"""OpenEnvEnvironment against a real OpenEnv server (tests/support/openenv_guess_server.py) run
as a subprocess: messages, rewards and done over several turns, concurrent sessions, errors."""

import asyncio
import logging
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("openenv.core", reason="needs openenv-core (make install)")

from forge.envs.base import EnvStep  # noqa: E402
from forge.envs.config import EnvConfig  # noqa: E402
from forge.envs.openenv import OpenEnvEnvironment  # noqa: E402
from forge.envs.sessions import EnvFailure, LocalEnvironments, Opening  # noqa: E402
from forge.replay_buffer import ReplayBufferConfig  # noqa: E402
from forge.rollout.env_failures import EnvFailures  # noqa: E402
from forge.rollout.step import RolloutCounts  # noqa: E402
from forge.runs.guards import starvation_message  # noqa: E402

pytestmark = pytest.mark.slow

SERVER = Path(__file__).resolve().parents[1] / "support" / "openenv_guess_server.py"
INTRO = "Guess my number (1-100), in at most 3 tries."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(max_sessions: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, str(SERVER), "--port", str(port), "--max-sessions", str(max_sessions)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return process, f"http://127.0.0.1:{port}"


def wait_until_up(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the OpenEnv test server exited with {process.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    pytest.fail(f"the OpenEnv test server did not answer at {url} within 30 s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two servers, started together: one for two sessions at a time, one for a single session."""
    logs = tmp_path_factory.mktemp("openenv")
    started = {name: start_server(n, logs / f"{name}.log") for name, n in (("two", 2), ("one", 1))}
    try:
        for name, (process, url) in started.items():
            wait_until_up(process, url, logs / f"{name}.log")
        yield {name: url for name, (_, url) in started.items()}
    finally:
        for process, _ in started.values():
            process.kill()
            process.wait()


@pytest.fixture
def url(servers):
    return servers["two"]


async def play(env: OpenEnvEnvironment, row: dict, guesses: list[str]) -> tuple[list, list[EnvStep]]:
    try:
        opening = await env.reset(row)
        return opening, [await env.step(guess) for guess in guesses]
    finally:
        await env.close()


def test_an_episode_over_several_turns_until_the_secret(url):
    env = OpenEnvEnvironment(base_url=url, reset_fields=["target"])
    opening, steps = asyncio.run(
        play(env, {"prompt": "Play a game.", "target": 42}, ["50", "forty", " 40 ", "42"])
    )
    assert opening == [{"role": "user", "content": f"Play a game.\n\n{INTRO}"}]
    assert steps == [
        EnvStep([{"role": "user", "content": "50: lower."}], reward=-0.08, done=False),
        # The server gives no reward (None) for text that is not a number.
        EnvStep([{"role": "user", "content": "'forty' is not a number."}], reward=0.0, done=False),
        EnvStep([{"role": "user", "content": "40: higher."}], reward=-0.02, done=False),
        EnvStep([{"role": "user", "content": "Correct!"}], reward=1.0, done=True),
    ]


def test_out_of_tries_ends_the_episode_with_tool_messages(url):
    env = OpenEnvEnvironment(base_url=url, role="tool", reset_fields=["target"])
    row = {"prompt": [{"role": "system", "content": "Answer with a number."}], "target": 7}
    opening, steps = asyncio.run(play(env, row, ["1", "100", "8"]))
    # The row's messages end with a system message: the reset text is a user message of its own.
    assert opening == [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": INTRO},
    ]
    assert steps == [
        EnvStep([{"role": "tool", "content": "1: higher."}], reward=-0.06, done=False),
        EnvStep([{"role": "tool", "content": "100: lower."}], reward=-0.93, done=False),
        EnvStep([{"role": "tool", "content": "No more tries: it was 7."}], reward=-0.01, done=True),
    ]


def test_another_observation_field_shown_as_json(url):
    env = OpenEnvEnvironment(base_url=url, observation_field="guesses", reset_fields=["seed"])
    opening, steps = asyncio.run(play(env, {"seed": 3}, ["abc", "0"]))
    assert opening == [{"role": "user", "content": "0"}]
    assert [(s.messages[0]["content"], s.done) for s in steps] == [("0", False), ("1", False)]


def test_concurrent_trajectories_keep_their_own_sessions(url):
    """Through forge's own LocalEnvironments, as a GRPO run builds it from its config."""
    envs = LocalEnvironments(
        "forge.envs.openenv:OpenEnvEnvironment",
        {"base_url": url, "reset_fields": ["target"]},
        step_timeout_s=60,
    )

    async def run():
        ids = ["a", "b"]
        try:
            openings = await envs.reset(ids, [{"target": 10}, {"target": 90}])
            return openings, [await envs.step(ids, [guess, guess]) for guess in ["30", "10"]]
        finally:
            await envs.close(ids)

    openings, turns = asyncio.run(run())
    assert openings == [Opening([{"role": "user", "content": INTRO}], None)] * 2
    assert turns == [
        [
            EnvStep([{"role": "user", "content": "30: lower."}], reward=-0.2),
            EnvStep([{"role": "user", "content": "30: higher."}], reward=-0.6),
        ],
        [
            EnvStep([{"role": "user", "content": "Correct!"}], reward=1.0, done=True),
            EnvStep([{"role": "user", "content": "10: higher."}], reward=-0.8),
        ],
    ]


def test_a_server_at_capacity_is_named_with_what_to_do(servers):
    async def run():
        first = OpenEnvEnvironment(base_url=servers["one"])
        second = OpenEnvEnvironment(base_url=servers["one"])
        try:
            await first.reset({})
            with pytest.raises((ConnectionError, RuntimeError)) as error:
                await second.reset({})
            return str(error.value)
        finally:
            await first.close()
            await second.close()

    message = asyncio.run(run())
    assert servers["one"] in message and "max_concurrent_envs" in message


def test_unreachable_server_names_the_url():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = OpenEnvEnvironment(base_url=url)
    with pytest.raises(
        ConnectionError, match=f"env.params.base_url: cannot reach an OpenEnv server at '{url}'"
    ):
        asyncio.run(play(env, {"prompt": "hi"}, []))


def test_wrong_field_names_are_named(url):
    env = OpenEnvEnvironment(base_url=url, action_field="guess")
    with pytest.raises(RuntimeError, match=r"VALIDATION_ERROR.*env.params.action_field \('guess'\)"):
        asyncio.run(play(env, {}, ["50"]))
    env = OpenEnvEnvironment(base_url=url, observation_field="text")
    with pytest.raises(ValueError, match=r"observation_field: 'text' .* \['guesses', 'message'\]"):
        asyncio.run(play(env, {}, []))
    env = OpenEnvEnvironment(base_url=url, reset_fields=["target"])
    with pytest.raises(ValueError, match=r"reset_fields: the row has no \['target'\]"):
        asyncio.run(play(env, {"prompt": "hi"}, []))


@pytest.mark.parametrize(
    "params, match",
    [
        ({"base_url": "127.0.0.1:8000"}, "base_url: '127.0.0.1:8000' is not a server url"),
        ({"base_url": "http://h:1", "role": "assistant"}, "role: 'assistant' is not one of user, tool"),
        ({"base_url": "http://h:1", "reset_fields": "seed"}, "reset_fields: 'seed' is not a list"),
        ({"base_url": "http://h:1", "action_field": ""}, "action_field: '' is not a field name"),
    ],
)
def test_bad_params_are_refused_at_construction(params, match):
    with pytest.raises(ValueError, match=match):
        OpenEnvEnvironment(**params)


def test_failures_reach_local_environments_as_env_failures():
    envs = LocalEnvironments(
        "forge.envs.openenv:OpenEnvEnvironment",
        {"base_url": f"http://127.0.0.1:{free_port()}"},
        step_timeout_s=60,
    )
    [failure] = asyncio.run(envs.reset(["a"], [{"prompt": "hi"}]))
    assert isinstance(failure, EnvFailure) and "cannot reach an OpenEnv server" in failure.message


def test_the_check_before_a_run_refuses_a_server_that_is_down_too_small_or_otherwise_named(servers):
    def check(sessions: int, **params) -> str | None:
        try:
            asyncio.run(OpenEnvEnvironment.check_before_run(params, sessions, {"prompt": "guess"}))
        except ValueError as e:
            return str(e)
        return None

    assert check(2, base_url=servers["two"]) is None
    too_small = check(2, base_url=servers["one"])
    assert too_small.startswith("with 2 sessions open at once, as the run holds them: ")
    assert servers["one"] in too_small and "max_concurrent_envs" in too_small
    assert "env.params.action_field ('guess')" in check(1, base_url=servers["two"], action_field="guess")
    assert "observation_field: 'text' is not a field" in check(
        1, base_url=servers["two"], observation_field="text"
    )
    down = f"http://127.0.0.1:{free_port()}"
    assert f"cannot reach an OpenEnv server at '{down}'" in check(1, base_url=down)
    # The server holds no session of the check's afterwards: a run can open its own.
    assert check(1, base_url=servers["one"]) is None


def test_a_server_that_dies_mid_run_fails_its_trajectories_summarised_and_the_starvation_names_it(
    tmp_path, caplog
):
    """The server goes away after the trajectories opened: each step fails (no traceback, no
    retry storm), the failures are logged once in full and then counted, and a starving run's
    message names the environment."""
    process, url = start_server(4, tmp_path / "server.log")
    wait_until_up(process, url, tmp_path / "server.log")
    name = "forge.envs.openenv:OpenEnvEnvironment"
    envs = LocalEnvironments(name, {"base_url": url}, step_timeout_s=10)
    ids = ["a", "b", "c", "d"]

    async def run():
        try:
            openings = await envs.reset(ids, [{}] * 4)
            process.kill()
            process.wait()
            return openings, await envs.step(ids, ["50"] * 4)
        finally:
            await envs.close(ids)

    openings, steps = asyncio.run(run())
    assert all(isinstance(o, Opening) for o in openings)
    assert all(isinstance(s, EnvFailure) and s.kind == "raised" and url in s.message for s in steps)
    failures = EnvFailures()
    with caplog.at_level(logging.WARNING, logger="forge.rollout.env_failures"):
        failures.report(steps)
        failures.dropped(4)
    assert [r.getMessage().split(" (")[0][:40] for r in caplog.records][1:] == [
        "3 more environment step() failures"
    ]
    report = starvation_message(
        RolloutCounts(groups_failed=4),
        {"added": 0, "evicted_stale": 0, "sampled": 0, "held": 0},
        {"errors": 0, "timeouts": 0},
        ReplayBufferConfig(),
        EnvConfig(name=name),
        failures,
    )
    assert f"Environment {name}: 4 groups dropped for its failures" in report
    assert "The environment's failures explain the starvation" in report
