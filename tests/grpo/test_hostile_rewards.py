"""Reward functions that raise, return None or end their process cost a run nothing: a GRPO
run with the default reward config (reward.timeout_s 5 s: the functions run in the reward
worker) completes, counts each function's errors, and leaves no reward worker behind. The same
run's eval reward raises on every answer, and it also scores with a group function and a reward server (a real one on 127.0.0.1, started
here): the server gets each rollout's responses in batches, a request it leaves hanging is
sent again (a retry, and no failure once the retry scores it), and every kind shows in the
metrics."""

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psutil
import pytest
from apps.grpo.main import main
from processes import children_left

pytestmark = pytest.mark.slow

# The reward actor's process (and its worker) imports the functions by module path: they live
# in a module written to a folder put on PYTHONPATH.
REWARDS_MODULE = """
import os
from pathlib import Path

def raises(prompt, response, target):
    raise RuntimeError("this reward is broken")

def returns_none(prompt, response, target):
    return None

def exits_once(prompt, response, target):
    marker = Path(os.environ["HOSTILE_TEST_EXIT_MARKER"])
    if not marker.exists():
        marker.touch()
        os._exit(1)  # like a crash in C code: no exception, the process is gone
    return 0.0

def by_characters(prompt, response, target):
    return sum(map(ord, response)) % 7 / 7  # varies within a group even for a random policy
"""


class ScoringServer(BaseHTTPRequestHandler):
    """Scores len(response) % 3; leaves the run's first request without an answer (the one
    before it is the check before the run, of one response)."""

    batches: list[int] = []
    release = threading.Event()

    def do_POST(self):
        items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["items"]
        self.batches.append(len(items))
        if len(self.batches) == 2:
            self.release.wait()
            return
        body = json.dumps({"scores": [len(item["response"]) % 3 for item in items]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def reward_workers(marker: str) -> list[psutil.Process]:
    """This test's live reward workers, wherever they are (an orphan is nobody's child)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if "forge.rewards.worker" in (process.info["cmdline"] or []) and (
                process.environ().get("HOSTILE_TEST_EXIT_MARKER") == marker
                and process.status() != psutil.STATUS_ZOMBIE
            ):
                found.append(process)
        except psutil.Error:
            continue
    return found


def test_a_run_with_hostile_rewards_completes_and_counts_their_errors(
    write_grpo_config, tmp_path, monkeypatch
):
    folder = tmp_path / "rewards_module"
    folder.mkdir()
    (folder / "hostile_rewards.py").write_text(REWARDS_MODULE)
    monkeypatch.syspath_prepend(str(folder))  # the config names it: checked here at start-up
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))
    marker = str(tmp_path / "exited_once")
    monkeypatch.setenv("HOSTILE_TEST_EXIT_MARKER", marker)
    hostile = [f"hostile_rewards:{name}" for name in ("raises", "returns_none", "exits_once")]
    functions = [f"{{name: '{name}'}}" for name in [*hostile, "hostile_rewards:by_characters"]]
    functions.append("{name: distinct, weight: 0.1}")  # a group function
    server = ThreadingHTTPServer(("127.0.0.1", 0), ScoringServer)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    remote = (
        f"{{url: 'http://127.0.0.1:{server.server_port}/score', batch_size: 4, timeout_s: 1.0, "
        "retries: 1, retry_backoff_s: 0.01}"
    )
    # timeout_s: the default
    config = write_grpo_config(reward=f"{{functions: [{', '.join(functions)}], remote: {remote}}}")
    try:
        # The eval's reward raises too: every answer counts as not solved, and the run goes on.
        main(["--config", str(config), "eval.reward_fn=hostile_rewards:raises"])
    finally:
        ScoringServer.release.set()
        server.shutdown()
        server.server_close()

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    errors = {name: sum(r.get(f"reward/{name}/errors", 0) for r in rows) for name in hostile}
    assert all(n > 0 for n in errors.values()), errors
    assert errors["hostile_rewards:exits_once"] == 1  # then it returned 0.0
    assert all(r["train/skipped"] == 0 for r in rows[1:])
    assert not any(f"reward/{name}/timeouts" in r for r in rows for name in hostile)
    # Recorded as the rollout loop scores, these reach the row of the flush that collects them: on
    # a loaded machine a step's scoring can land in the next step's row, so not every row has them.
    trained = rows[1:]
    assert all(any(f"reward/{name}" in r for r in trained) for name in ("distinct", "remote")), trained
    # The hung request was sent again and scored: a retry, no failure.
    assert sum(r.get("reward/remote/retries", 0) for r in rows) == 1
    assert not any(
        f"reward/{name}/{kind}" in r
        for r in rows
        for name in ("distinct", "remote")
        for kind in ("errors", "timeouts")
    )
    # 8 eval answers at each of steps 0-3, each scored 0 (not solved) and counted.
    assert sum(r.get("eval/reward/hostile_rewards:raises/errors", 0) for r in rows) == 32
    assert all(r["eval/accuracy"] == 0.0 for r in rows)
    # Each rollout: 2 prompts x 4 responses, in two requests of 4 (and the hung one's retry).
    assert ScoringServer.batches[0] == 1 and set(ScoringServer.batches[1:]) == {4}
    children_left(15)  # actor processes take a moment to exit after their mesh is stopped
    assert reward_workers(marker) == []
