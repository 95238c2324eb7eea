"""Multi-host set-up without a controller: the worker's command line and its mutual TLS, the
provisioner's host settings, where meshes go, and the reachability check. (A GRPO run over two
workers: tests/grpo/test_grpo_multihost.py.)"""

import socket
import ssl
import subprocess
import sys

import pytest
from host_workers import Worker, free_port, make_tls_files, worker_env
from pydantic import ValidationError

from forge.controller import ProvisionerConfig
from forge.controller.gpu_pool import GpuPool
from forge.controller.hosts import AttachedHosts, HostUnreachableError, check_reachable, parse_worker_address


def run_worker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "forge.worker", *args],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_worker_refuses_to_start_without_tls_unless_insecure():
    result = run_worker("--port", "26600")
    assert result.returncode == 2
    assert "no TLS files" in result.stderr and "--insecure" in result.stderr


def test_worker_names_a_missing_or_partial_tls_setting(tmp_path):
    result = run_worker("--port", "26600", "--tls-ca", str(tmp_path / "ca.crt"))
    assert result.returncode == 2
    assert "give all three of --tls-ca, --tls-cert and --tls-key" in result.stderr
    missing = tmp_path / "nope.crt"
    result = run_worker("--port", "26600", "--tls-ca", str(missing), "--tls-cert", "a", "--tls-key", "b")
    assert result.returncode == 2
    assert f"TLS CA certificate file not found: {missing}" in result.stderr


def test_worker_addresses_are_parsed_or_rejected_with_the_expected_form():
    assert parse_worker_address("tls://node1:26600") == ("tls", "node1", 26600)
    assert parse_worker_address("tcp://127.0.0.1:5") == ("tcp", "127.0.0.1", 5)
    for bad in ("node1:26600", "tls://node1", "http://node1:80", "tls://node1:port"):
        with pytest.raises(ValueError, match="tls://HOST:PORT"):
            parse_worker_address(bad)


def test_provisioner_config_checks_hosts_and_placement():
    cfg = ProvisionerConfig(hosts=["tls://a:1", "tls://b:1"], placement={"Generator": [1]})
    assert cfg.tls
    assert cfg.placement_for("Generator") == [1]
    assert cfg.placement_for("ReplayBuffer") == [0]
    assert cfg.placement_for("torchstore") == [0]
    # The store's volume follows the trainer unless placed itself.
    assert ProvisionerConfig(hosts=["tls://a:1", "tls://b:1"], placement={"TitanTrainer": [1]}).placement_for(
        "torchstore"
    ) == [1]
    with pytest.raises(ValidationError, match="mixes tls:// and tcp://"):
        ProvisionerConfig(hosts=["tls://a:1", "tcp://b:1"])
    with pytest.raises(
        ValidationError, match=r"provisioner.placement.Generator: \[2\] must list host indices in 0..1"
    ):
        ProvisionerConfig(hosts=["tls://a:1", "tls://b:1"], placement={"Generator": [2]})
    with pytest.raises(ValidationError, match="tls_ca, tls_cert and tls_key go together"):
        ProvisionerConfig(hosts=["tls://a:1"], tls_ca="ca.crt")


def test_replicas_take_the_listed_hosts_in_turn_and_a_mesh_spans_consecutive_hosts():
    cfg = ProvisionerConfig(hosts=[f"tcp://h{i}:1" for i in range(4)], placement={"Generator": [1, 2, 3]})
    hosts = AttachedHosts(cfg.hosts, cfg.placement_for)
    assert [hosts.hosts_for(f"Generator_{i}", 1) for i in range(4)] == [[1], [2], [3], [1]]
    assert hosts.hosts_for("TitanTrainer_9", 1) == [0]
    with pytest.raises(ValueError, match="spans 2 hosts but provisioner.placement.TitanTrainer lists 1"):
        hosts.hosts_for("TitanTrainer_10", 2)
    hosts = AttachedHosts(
        cfg.hosts, ProvisionerConfig(hosts=cfg.hosts, placement={"X": [3, 1]}).placement_for
    )
    with pytest.raises(ValueError, match=r"spans hosts \[3, 1\], which are not consecutive"):
        hosts.hosts_for("X_0", 2)


def test_a_gpu_group_shares_its_gpus_on_the_same_hosts_and_frees_them_with_its_last_mesh():
    """The reference model (2 procs a host, group "trainer") on the trainer's GPUs of hosts 0-1;
    GPUs as the workers would report them at attach."""
    hosts = AttachedHosts([f"tcp://h{i}:1" for i in range(3)], ProvisionerConfig().placement_for)
    hosts.pools = [
        GpuPool(gpus, where=f" on host {i}")
        for i, gpus in enumerate([["0", "1", "2"], ["0", "1", "2"], ["0", "1"]])
    ]
    trainer = hosts.take_gpus([0, 1], 2, "TitanTrainer_0", "trainer")
    reference = hosts.take_gpus([0, 1], 2, "ReferenceModel_1", "trainer")
    assert trainer == reference == [["0", "1"], ["0", "1"]]
    assert hosts.free_gpus == [["2"], ["2"], ["0", "1"]]
    # Another span of hosts, or no group: GPUs of their own.
    assert hosts.take_gpus([1, 2], 1, "ReferenceModel_2", "trainer") == [["2"], ["0"]]
    with pytest.raises(
        RuntimeError, match="needs 3 GPU\\(s\\) on host 0 but its GPU group 'trainer' has 2 there"
    ):
        hosts.take_gpus([0, 1], 3, "ReferenceModel_3", "trainer")
    hosts.give_back_gpus([0, 1], trainer, "trainer")
    assert hosts.free_gpus[:2] == [["2"], []]  # still the reference's
    hosts.give_back_gpus([0, 1], reference, "trainer")
    assert hosts.free_gpus[:2] == [["2", "0", "1"], ["0", "1"]]
    # The group's last mesh stopped: a new one takes free GPUs again.
    assert hosts.take_gpus([0, 1], 1, "TitanTrainer_4", "trainer") == [["2"], ["0"]]


def test_an_unreachable_worker_is_named_before_monarch_waits_on_it():
    address = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(
        HostUnreachableError, match=rf"provisioner.hosts\[0\]: worker {address} is unreachable"
    ):
        check_reachable([address], timeout_s=5)


def test_grpo_trainer_hosts_need_workers_and_count_in_the_dp_size():
    from forge.grpo.config import GRPOConfig

    base = {"policy_path": "p", "generator": {"model_path": "p"}}
    trainer = {"engine": {"model": {"flavor": "tiny"}}, "hosts": 2}
    with pytest.raises(
        ValidationError, match=r"trainer.hosts \(2\) exceeds the hosts in provisioner.hosts \(0\)"
    ):
        GRPOConfig.model_validate({**base, "trainer": trainer})
    two_hosts = {"hosts": ["tcp://a:1", "tcp://b:1"], "placement": {"TitanTrainer": [0, 1]}}
    # One process on each of two hosts: two data-parallel ranks.
    cfg = GRPOConfig.model_validate({**base, "trainer": trainer, "provisioner": two_hosts})
    assert cfg.trainer.hosts == 2 and cfg.dp_size == 2
    with pytest.raises(
        ValidationError, match=r"batch_size \(3\) must be a multiple of the trainer's data-parallel size \(2"
    ):
        GRPOConfig.model_validate(
            {**base, "trainer": trainer, "provisioner": two_hosts, "replay_buffer": {"batch_size": 3}}
        )


def _handshake(port: int, ca: str, cert: str | None = None, key: str | None = None) -> str:
    """A TLS handshake with a worker; "ok" or the reason it failed."""
    context = ssl.create_default_context(cafile=ca)
    if cert:
        context.load_cert_chain(cert, key)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                tls.settimeout(2)
                try:
                    tls.recv(1)  # with TLS 1.3 a refused client certificate shows on the first read
                except TimeoutError:
                    pass
        return "ok"
    except ssl.SSLError as e:
        return e.reason or str(e)


def test_a_worker_speaks_mutual_tls_only_with_certificates_of_its_ca(tmp_path):
    ours, theirs = make_tls_files(tmp_path / "ours"), make_tls_files(tmp_path / "theirs", "another-ca")
    worker = Worker(ours, tmp_path)
    try:
        assert worker.address == f"tls://127.0.0.1:{worker.port}"
        assert _handshake(worker.port, ours["ca"], ours["cert"], ours["key"]) == "ok"
        assert _handshake(worker.port, ours["ca"]) == "TLSV13_ALERT_CERTIFICATE_REQUIRED"
        assert _handshake(worker.port, ours["ca"], theirs["cert"], theirs["key"]) == "TLSV1_ALERT_UNKNOWN_CA"
        assert (
            _handshake(worker.port, theirs["ca"], theirs["cert"], theirs["key"])
            == "CERTIFICATE_VERIFY_FAILED"
        )
    finally:
        worker.stop()
