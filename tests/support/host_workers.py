"""Host workers on localhost for multi-host tests: a throwaway TLS CA, and `python -m forge.worker`
processes on different ports standing in for separate hosts."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def make_tls_files(root: Path, ca_name: str = "forge-test-ca") -> dict[str, str]:
    """A CA and one certificate it signed for localhost/127.0.0.1 (used by workers and
    controller alike), made with the openssl CLI."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "san.cnf").write_text(
        "[req]\ndistinguished_name = dn\nreq_extensions = v3\n[dn]\n"
        "[v3]\nsubjectAltName = DNS:localhost,IP:127.0.0.1\n"
    )
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for command in (
        ["openssl", "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", f"/CN={ca_name}"],
        ["openssl", "req", *ec, "-keyout", "host.key", "-out", "host.csr", "-subj", "/CN=localhost", "-config", "san.cnf"],
        ["openssl", "x509", "-req", "-in", "host.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "host.crt", "-days", "1", "-extfile", "san.cnf", "-extensions", "v3"],
    ):  # fmt: skip
        subprocess.run(command, cwd=root, check=True, capture_output=True)
    return {"ca": str(root / "ca.crt"), "cert": str(root / "host.crt"), "key": str(root / "host.key")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict[str, str]:
    """The environment of a worker, and so of the actor processes it spawns: forge and apps
    importable from this checkout."""
    path = os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


class Worker:
    """`python -m forge.worker` on 127.0.0.1:port, in a session of its own. Its output (and
    that of the processes it spawns) goes to a file: a pipe nobody reads would block them."""

    def __init__(self, tls: dict[str, str], log_dir: Path, timeout_s: float = 120):
        self.port = free_port()
        self.log = log_dir / f"worker-{self.port}.log"
        command = [sys.executable, "-m", "forge.worker", "--port", str(self.port), "--host", "127.0.0.1"]
        command += ["--tls-ca", tls["ca"], "--tls-cert", tls["cert"], "--tls-key", tls["key"]]
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                command, env=worker_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        ready = re.compile(r"forge worker ready: attach with (\S+)\n")
        deadline = time.time() + timeout_s
        while not (found := ready.search(self.log.read_text())):
            if self.process.poll() is not None:
                raise AssertionError(f"the worker exited:\n{self.log.read_text()}")
            if time.time() > deadline:
                self.stop()
                raise AssertionError(f"the worker did not start in {timeout_s} s:\n{self.log.read_text()}")
            time.sleep(0.1)
        self.address = found.group(1)

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        """Kills the worker alone, as a host failure would (its processes go with it)."""
        self.process.kill()
        self.process.wait(timeout=30)

    def stop(self) -> None:
        """Kills the worker and everything it spawned."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)
