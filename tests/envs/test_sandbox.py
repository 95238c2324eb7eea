"""The sandbox for model-written code, with real processes: normal runs, escapes, limits."""

import asyncio
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

from forge.envs.sandbox import SandboxLimits, run_python, run_python_sync

CHECKOUT = Path(__file__).resolve().parents[2]
SANDBOX_UID = "65534"


def sandbox_processes() -> list[int]:
    """Host pids of live (not zombie) processes running as the sandbox's uid."""
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines())
        except OSError:  # exited while we looked
            continue
        if fields["Uid"].split()[0] == SANDBOX_UID and not fields["State"].strip().startswith("Z"):
            pids.append(int(status.parent.name))
    return pids


def test_runs_code_and_returns_its_output():
    result = run_python_sync("print(sum(range(10)))")
    assert (result.stdout, result.stderr, result.exit_code) == ("45\n", "", 0)
    assert not result.timed_out and not result.output_truncated


def test_syntax_error_gives_traceback_and_nonzero_exit():
    result = run_python_sync("print(1 +")
    assert result.exit_code != 0
    assert "SyntaxError" in result.stderr and 'File "/tmp/main.py"' in result.stderr


def test_stdin_is_empty():
    result = run_python_sync("import sys; print(repr(sys.stdin.read()))")
    assert result.stdout == "''\n"


def test_cannot_connect_to_a_listening_socket_on_host_loopback():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=2):  # the host can
            server.accept()[0].close()
        code = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    print('connected')\n"
            "except OSError as e:\n"
            "    print('failed:', e)\n"
        )
        result = run_python_sync(code)
        assert result.stdout.startswith("failed:"), result
        server.setblocking(False)
        try:
            server.accept()
            raise AssertionError("the sandbox reached the host's socket")
        except BlockingIOError:
            pass


def test_cannot_write_outside_its_tmp(tmp_path):
    name = f"escape-{uuid.uuid4().hex}.txt"
    targets = [tmp_path / name, CHECKOUT / name, Path("/") / name]
    code = "import os\n" + "".join(
        f"try:\n    open({str(t)!r}, 'w').write('x')\n    print('wrote', {str(t)!r})\n"
        f"except OSError as e:\n    print('refused', e)\n"
        for t in targets
    )
    code += "open('own.txt', 'w').write('mine')\nprint(open('/tmp/own.txt').read())\n"
    result = run_python_sync(code)
    assert result.exit_code == 0, result
    assert result.stdout.count("refused") == len(targets) and result.stdout.endswith("mine\n")
    assert not any(t.exists() for t in targets)


def test_cannot_read_host_files(tmp_path):
    secret = f"secret-{uuid.uuid4().hex}"
    (tmp_path / "secret.txt").write_text(secret)
    pyproject = (CHECKOUT / "pyproject.toml").read_text()
    code = (
        "import os\n"
        f"for path in [{str(tmp_path / 'secret.txt')!r}, {str(CHECKOUT / 'pyproject.toml')!r}]:\n"
        "    try:\n"
        "        print(open(path).read())\n"
        "    except OSError as e:\n"
        "        print('refused', e)\n"
        "print(sorted(os.listdir('/')), os.listdir('/tmp'))\n"
    )
    result = run_python_sync(code)
    assert result.stdout.count("refused") == 2, result
    assert secret not in result.stdout + result.stderr and pyproject not in result.stdout
    # Only the system's programs and libraries, the interpreter's prefix, and the sandbox's own dirs.
    links = [name for name in ("bin", "sbin", "lib", "lib64") if os.path.lexists(f"/{name}")]
    top = sorted({"dev", "proc", "tmp", "usr", *links, Path(sys.base_prefix).resolve().parts[1]})
    assert result.stdout.endswith(f"{top} ['main.py']\n"), result


def test_fork_bomb_is_contained_and_cleaned_up():
    limits = SandboxLimits(max_processes=8, wall_s=2)
    code = (
        "import os, time\n"
        "children = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(60)\n"
        "            os._exit(0)\n"
        "        children += 1\n"
        "except OSError as e:\n"
        "    print('fork failed after', children, 'children:', e.strerror, flush=True)\n"
        "while True:\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        pass\n"
    )
    before = len(sandbox_processes())
    most = 0

    async def run_and_watch():
        nonlocal most
        run = asyncio.ensure_future(run_python(code, limits))
        while not run.done():
            most = max(most, len(sandbox_processes()))
            await asyncio.sleep(0.05)
        return await run

    start = time.monotonic()
    result = asyncio.run(run_and_watch())
    assert time.monotonic() - start < limits.wall_s + 2
    assert result.stdout.startswith("fork failed after 7 children:"), result
    assert result.timed_out and result.exit_code is None
    assert before < most <= before + limits.max_processes
    assert len(sandbox_processes()) == before


def test_infinite_loop_is_killed_by_the_cpu_limit():
    result = run_python_sync("while True: pass", SandboxLimits(cpu_s=1, wall_s=10))
    assert result.exit_code == 128 + signal.SIGXCPU and not result.timed_out


def test_sleeping_code_is_killed_at_the_wall_timeout():
    start = time.monotonic()
    result = run_python_sync("import time; time.sleep(100)", SandboxLimits(wall_s=1))
    assert time.monotonic() - start < 3
    assert result.timed_out and result.exit_code is None


def test_huge_output_is_truncated():
    result = run_python_sync("print('x' * 10**8)", SandboxLimits(max_output_bytes=1000))
    assert result.stdout == "x" * 1000 and result.output_truncated


def test_allocating_4_gb_fails():
    result = run_python_sync("b = bytearray(4 * 2**30)\nprint('allocated')")
    assert result.exit_code != 0 and "MemoryError" in result.stderr and result.stdout == ""


def test_writing_a_file_over_the_size_limit_fails():
    result = run_python_sync("open('big', 'wb').write(b'x' * 2**21)", SandboxLimits(max_file_mb=1))
    assert result.exit_code != 0 and "OSError" in result.stderr, result


def test_background_child_is_killed_when_the_code_exits():
    before = set(sandbox_processes())
    code = (
        "import subprocess\n"
        "p = subprocess.Popen(['sleep', '100'], start_new_session=True)\n"
        "print('running' if p.poll() is None else 'not started')\n"
    )
    result = run_python_sync(code)
    assert result.stdout == "running\n" and result.exit_code == 0
    assert set(sandbox_processes()) == before


def test_concurrent_runs_return_their_own_results():
    async def run_four():
        return await asyncio.gather(*(run_python(f"print({i} * {i})") for i in range(4)))

    results = asyncio.run(run_four())
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(4)]
    assert all(r.exit_code == 0 for r in results)
