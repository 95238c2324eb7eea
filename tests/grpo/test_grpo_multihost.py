"""GRPO over two "hosts": two `python -m forge.worker` processes on localhost (different ports),
with mutual TLS from a throwaway CA. The trainer (and the weight store's volume) runs on host 0,
the generator on host 1, the other actors on host 0. The weights are broadcast by the trainer
(a gloo group over the hosts' addresses), or cross through the store (`auto` across hosts) in
the run whose worker is killed, which loads a version from the store before the kill.

The app runs as a subprocess, as a user would start it: it switches Monarch to the TLS
transport, which a process can do only before Monarch starts in it.
"""

import json
import os
import subprocess
import sys
import time

import pytest
from host_workers import REPO, Worker, free_port, make_tls_files, worker_env

from forge.runs.restarts import ACTOR_FAILED_EXIT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def workers(tls, tmp_path):
    started = []
    try:
        started += [Worker(tls, tmp_path), Worker(tls, tmp_path)]
        yield started
    finally:
        for worker in started:
            worker.stop()


def multihost_config(write_grpo_config, tls: dict, addresses: list[str], **extra: str):
    hosts = ", ".join(f"'{a}'" for a in addresses)
    return write_grpo_config(
        provisioner=(
            f"{{hosts: [{hosts}], placement: {{TitanTrainer: [0], Generator: [1]}}, "
            f"controller_host: 127.0.0.1, tls_ca: {tls['ca']}, tls_cert: {tls['cert']}, "
            f"tls_key: {tls['key']}, attach_timeout_s: 60, host_timeout_s: 5}}"
        ),
        **extra,
    )


def start_app(config, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "apps.grpo.main", "--config", str(config), *overrides],
        env=worker_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_trainer_and_generator_on_two_hosts(write_grpo_config, tls, workers, tmp_path):
    config = multihost_config(write_grpo_config, tls, [w.address for w in workers])
    app = start_app(config, "generator.weight_transport=broadcast")
    try:
        output = app.communicate(timeout=600)[0]
    finally:
        app.kill()
    assert app.returncode == 0, output[-3000:]
    assert any(line.split("|")[0].split() == ["step", "3/3"] for line in output.splitlines()), output[-3000:]

    placement = {
        p["mesh"].rsplit("_", 1)[0]: p for p in json.loads((tmp_path / "run" / "placement.json").read_text())
    }
    expected_host = {"TitanTrainer": 0, "Generator": 1, "torchstore": 0, "ReplayBuffer": 0, "RewardActor": 0}
    for mesh, host in expected_host.items():
        assert placement[mesh]["hosts"] == [host], placement[mesh]
        assert placement[mesh]["addresses"] == [workers[host].address]
        # Every process of the mesh was spawned by that host's worker.
        assert {p["ppid"] for p in placement[mesh]["procs"]} == {workers[host].pid}, mesh
    assert placement["TitanTrainer"]["procs"][0]["pid"] != os.getpid()

    # The generator on host 1 loaded each version the trainer on host 0 published.
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["generator/version"] for r in rows[1:]] == [1, 2, 3]  # row 0: the initial eval


def test_a_wrong_worker_address_is_named(write_grpo_config, tls, workers):
    wrong = f"tls://127.0.0.1:{free_port()}"
    config = multihost_config(write_grpo_config, tls, [workers[0].address, wrong])
    app = start_app(config)
    try:
        output = app.communicate(timeout=120)[0]
    finally:
        app.kill()
    assert app.returncode != 0
    assert f"provisioner.hosts[1]: worker {wrong} is unreachable" in output, output[-3000:]


def test_a_worker_killed_mid_run_stops_the_run_naming_it(write_grpo_config, tls, workers, tmp_path):
    config = multihost_config(write_grpo_config, tls, [w.address for w in workers])
    app = start_app(config, "max_steps=100000")
    seen = []
    try:
        deadline = time.time() + 300
        for line in app.stdout:
            seen.append(line)
            if line.split("/")[0].split() == ["step", "3"]:  # the progress line of step 3
                break
            assert time.time() < deadline, "the run did not reach step 3:\n" + "".join(seen[-30:])
        else:
            raise AssertionError("the run ended before step 3:\n" + "".join(seen[-30:]))
        # Step 3 trained on episodes of version 1 or later (replay_buffer.max_policy_age 1): the
        # generator on host 1 had loaded a version through the store.
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert max(r.get("generator/version", 0) for r in rows) >= 1, rows
        workers[1].kill()
        output = "".join(seen) + app.communicate(timeout=180)[0]
    finally:
        app.kill()
    assert app.returncode == ACTOR_FAILED_EXIT, output[-3000:]
    # Named like a dead actor, with the host it ran on (whether the run learns of the death from
    # the failed call or from Monarch's supervision first, the line names both).
    error = next((line for line in output.splitlines() if line.startswith("error: actor Generator_1 ")), "")
    assert f"actor Generator_1 (on host 1 ({workers[1].address}))" in error, output[-3000:]
