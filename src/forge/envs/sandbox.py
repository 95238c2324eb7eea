"""Run model-written Python code in a Linux-namespace sandbox (the Python tool of agent envs).

Mechanism: util-linux's `unshare`, run as root, starts a shell in new mount, PID, network, IPC
and UTS namespaces. That shell is PID 1 of the new PID namespace: it builds a minimal root on a
tmpfs, `pivot_root`s into it and detaches the host's tree, then runs the code as uid 65534
(nobody) with no new privileges, inside a user namespace of its own, under `prlimit`. The kernel
enforces everything; there is no Python-level restriction. We use util-linux rather than
bubblewrap because it is on every Debian machine already and needs no extra package.

Visible inside (the rest of the host's filesystem is not in the mount namespace at all):
- /usr, and /bin, /sbin, /lib, /lib64 as on the host (symlinks into /usr, or read-only binds);
- the interpreter's prefix (`sys.base_prefix`, e.g. /root/.pyenv/versions/3.11.7), read-only,
  with the packages installed there (not the project's virtual environment);
- /dev/null, /dev/zero, /dev/full, /dev/random, /dev/urandom;
- /proc of the sandbox's own PID namespace (it lists the sandbox's processes only);
- /tmp: a fresh tmpfs of `max_file_mb` MB owned by the sandbox's user, its working directory and
  HOME, holding main.py (the code); it disappears with the namespace. There is no /dev/shm, so
  multiprocessing's locks and queues do not work.
The root is a read-only tmpfs: there is no /etc, /home, /work, /sys, /run, /var, no other part
of /root, and no /tmp of the host. The network namespace has only a loopback that is down, so
every connect fails, to 127.0.0.1 too.

Limits (SandboxLimits):
- cpu_s: RLIMIT_CPU of each process (SIGXCPU at cpu_s, SIGKILL one second later);
- memory_mb: RLIMIT_AS of each process;
- max_processes: RLIMIT_NPROC. The kernel ignores it for root, and counts processes per user
  and user namespace: a non-root uid in a user namespace of its own makes it hold for this
  sandbox alone, so a fork bomb fails at max_processes without touching other sandboxes;
- max_file_mb: RLIMIT_FSIZE, and the size of /tmp (so also the total written);
- max_output_bytes: per stream; once stdout or stderr passes it, the sandbox is killed;
- wall_s: then the sandbox is killed. Killing is SIGKILL to the process group of `unshare` and
  the namespace's PID 1; when PID 1 dies the kernel kills every process of the namespace, so
  nothing survives (setsid or daemonizing does not escape it). run_python returns once `unshare`
  has exited and every process holding the code's stdout or stderr is gone; `unshare
  --kill-child` kills the sandbox the same way when the caller itself dies.

Needs root (for the mounts and the switch to uid 65534) and user namespaces; where either is
missing, run_python raises SandboxUnavailableError and runs nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import tempfile
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_SANDBOX_UID = 65534  # nobody: any non-root uid, since root is exempt from RLIMIT_NPROC
_READY = b"forge-sandbox-ready\n"  # see _ANNOUNCE
# One thread for BLAS: OpenBLAS reserves buffers per host core, which on a 16-core machine is past
# the default RLIMIT_AS, so `import numpy` would fail.
_ENV = {
    "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "HOME": "/tmp",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
}

# Runs as root and PID 1 of the new namespaces, with the code on stdin. Arguments: the mount point
# of the new root, the size of /tmp in MB, the sandbox uid, the host paths to show read-only,
# "--", then the command that runs the code.
_SETUP = r"""
set -eu
root=$1 tmp_mb=$2 uid=$3
shift 3
mount -t tmpfs -o mode=755,nosuid,nodev forge-sandbox-root "$root"
while [ "$1" != -- ]; do
    if [ -L "$1" ]; then
        ln -s "$(readlink "$1")" "$root$1"
    else
        mkdir -p "$root$1"
        mount --bind "$1" "$root$1"
        mount -o remount,bind,ro,nosuid,nodev "$root$1"
    fi
    shift
done
shift
mkdir "$root/dev" "$root/proc" "$root/tmp"
for dev in null zero full random urandom; do
    touch "$root/dev/$dev"
    mount --bind "/dev/$dev" "$root/dev/$dev"
done
mount -t proc -o nosuid,nodev,noexec proc "$root/proc"
mount -t tmpfs -o "size=${tmp_mb}m,mode=700,uid=$uid,gid=$uid,nosuid,nodev" forge-sandbox-tmp "$root/tmp"
cat > "$root/tmp/main.py"
mount -o remount,bind,ro "$root"
cd "$root"
pivot_root . .
umount -l .
cd /tmp
unset OLDPWD  # it names the host path of the new root
"$@" < /dev/null
"""

# Printed once the user namespace exists, the last step that can fail for lack of support: output
# that does not start with it means the sandbox could not be set up (not that the code failed).
_ANNOUNCE = 'echo forge-sandbox-ready && exec "$@"'


class SandboxUnavailableError(RuntimeError):
    """The sandbox cannot be set up on this machine, so the code was not run."""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 5
    memory_mb: int = 512
    max_processes: int = 32
    max_output_bytes: int = 16 * 1024
    max_file_mb: int = 8
    wall_s: float = 10.0


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # 128+N if killed by signal N; None if the sandbox killed it
    timed_out: bool
    output_truncated: bool


def _visible_paths(python: str) -> list[str]:
    paths = [p for p in ("/usr", "/bin", "/sbin", "/lib", "/lib64") if os.path.lexists(p)]
    prefix = os.path.realpath(sys.base_prefix)
    if os.path.commonpath([prefix, "/usr"]) != "/usr":
        paths.append(prefix)
    if not any(os.path.commonpath([python, p]) == p for p in paths):
        raise SandboxUnavailableError(
            f"the interpreter {python} is outside {paths}, so the sandbox could not run it: "
            "use a Python installed under /usr or whose sys.base_prefix contains it"
        )
    return paths


def _command(root: str, limits: SandboxLimits) -> list[str]:
    python = os.path.realpath(sys.executable)  # a venv's python is a link to the base one
    run_code = [
        *("setpriv", f"--reuid={_SANDBOX_UID}", f"--regid={_SANDBOX_UID}"),
        *("--clear-groups", "--no-new-privs", "--"),
        *("unshare", "--user", "--map-current-user", "--"),
        *("sh", "-c", _ANNOUNCE, "forge-sandbox"),
        *("prlimit", f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}", f"--as={limits.memory_mb * 2**20}"),
        *(f"--nproc={limits.max_processes}", f"--fsize={limits.max_file_mb * 2**20}", "--"),
        *(python, "-I", "main.py"),
    ]
    return [
        *("unshare", "--mount", "--pid", "--net", "--ipc", "--uts", "--fork", "--kill-child", "--"),
        *("sh", "-c", _SETUP, "forge-sandbox", root, str(limits.max_file_mb), str(_SANDBOX_UID)),
        *_visible_paths(python),
        "--",
        *run_code,
    ]


async def _feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    try:
        stdin.write(data)
        await stdin.drain()
        stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the set-up failed before reading the code: the missing _READY reports it


async def _read_capped(stream: asyncio.StreamReader, cap: int, on_overflow) -> tuple[bytes, bool]:
    """Reads `stream` to its end, keeping the first `cap` bytes; calls on_overflow once past it."""
    kept, total = bytearray(), 0
    while chunk := await stream.read(65536):
        kept += chunk[: cap - len(kept)]
        total += len(chunk)
        if total > cap and total - len(chunk) <= cap:
            on_overflow()
    return bytes(kept), total > cap


async def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Runs `code` as main.py in a fresh sandbox; see the module docstring for what it may do."""
    if os.geteuid() != 0:
        raise SandboxUnavailableError(
            "the sandbox needs root: it mounts a private root filesystem and switches to uid "
            f"{_SANDBOX_UID}; run forge as root (as in the CI and GPU containers)"
        )
    root = tempfile.mkdtemp(prefix="forge-sandbox-")  # only a mount point, inside the namespace
    try:
        return await _run(code, limits, root)
    finally:
        os.rmdir(root)


async def _run(code: str, limits: SandboxLimits, root: str) -> SandboxResult:
    try:
        proc = await asyncio.create_subprocess_exec(
            *_command(root, limits),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=_ENV,
            start_new_session=True,  # its own process group, which kill() signals as a whole
        )
    except FileNotFoundError as e:
        raise SandboxUnavailableError(f"cannot start the sandbox: {e}; install util-linux") from e
    killed = False

    def kill() -> None:
        nonlocal killed
        killed = True
        if proc.returncode is None:  # not reaped yet, so its pid is still its process group's
            os.killpg(proc.pid, signal.SIGKILL)

    outputs = asyncio.ensure_future(
        asyncio.gather(
            _feed(proc.stdin, code.encode()),
            _read_capped(proc.stdout, len(_READY) + limits.max_output_bytes, kill),
            _read_capped(proc.stderr, limits.max_output_bytes, kill),
            proc.wait(),
        )
    )
    try:
        done, _ = await asyncio.wait({outputs}, timeout=limits.wall_s)
    finally:
        if not outputs.done():  # past wall_s, or this coroutine was cancelled
            kill()
    _, (stdout, stdout_cut), (stderr, stderr_cut), returncode = await outputs
    started = stdout.startswith(_READY)
    if not started and not killed:
        raise SandboxUnavailableError(
            f"the sandbox could not be set up (exit code {returncode}), so the code did not run: "
            f"{stderr.decode(errors='replace').strip()}"
        )
    result = SandboxResult(
        stdout=stdout[len(_READY) :].decode(errors="replace") if started else "",
        stderr=stderr.decode(errors="replace"),
        exit_code=None if killed else returncode,
        timed_out=not done,
        output_truncated=stdout_cut or stderr_cut,
    )
    logger.debug(
        "sandbox: exit %s, timed out %s, output truncated %s",
        result.exit_code,
        result.timed_out,
        result.output_truncated,
    )
    return result


def run_python_sync(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """run_python for callers without an event loop."""
    return asyncio.run(run_python(code, limits))
