"""A GRPO run scores with a reward function, a group function and a reward server together: the
server (a real one on 127.0.0.1, started here) gets each rollout's responses in batches, a
request it leaves hanging is counted and sent again, and every kind shows in the metrics."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from apps.grpo.main import main

DISTINCT = "forge.data.group_rewards:distinct_in_group"


class Handler(BaseHTTPRequestHandler):
    """Scores len(response) % 3; leaves its first request without an answer."""

    batches: list[int] = []
    release = threading.Event()

    def do_POST(self):
        items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["items"]
        self.batches.append(len(items))
        if len(self.batches) == 1:
            self.release.wait()
            return
        body = json.dumps({"scores": [len(item["response"]) % 3 for item in items]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_run_scores_with_a_function_a_group_function_and_a_reward_server(write_grpo_config, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/score"
    reward = (
        f"{{functions: [{{name: toy_task}}, {{name: '{DISTINCT}', weight: 0.1}}], "
        f"remote: {{url: '{url}', batch_size: 4, timeout_s: 1.0, retries: 1, retry_backoff_s: 0.01}}}}"
    )
    config = write_grpo_config(reward=reward)
    try:
        main(["--config", str(config), "max_steps=1"])
    finally:
        Handler.release.set()
        server.shutdown()
        server.server_close()

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["step"] >= 1]
    assert trained and all(
        f"reward/{name}" in r for r in trained for name in ("toy_task", DISTINCT, "remote")
    ), trained
    assert sum(r.get("reward/remote/timeouts", 0) for r in rows) == 1
    assert sum(r.get("reward/remote/retries", 0) for r in rows) == 1
    assert not any(key.endswith("/errors") for r in rows for key in r)
    # Each rollout: 2 prompts x 4 responses, in two requests of 4 (and the hung one's retry).
    assert Handler.batches and set(Handler.batches) == {4}
