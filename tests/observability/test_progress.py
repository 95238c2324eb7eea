"""Progress: a tqdm bar with ETA on a real terminal (a pty), plain lines on a file."""

import fcntl
import io
import os
import pty
import struct
import termios

from forge.observability.progress import Progress, format_duration


def test_plain_lines_when_not_a_terminal():
    stream = io.StringIO()
    progress = Progress(10, desc="grpo", every=4, stream=stream)
    assert not progress.is_bar
    progress.message("step 0 | eval acc 0.250 (initial policy)")
    for step in range(1, 11):
        progress.update(step, {"reward": f"{step / 10:.3f}", "gen": "100 tok/s"}, persist=step == 5)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "step 0 | eval acc 0.250 (initial policy)"
    # Every 4th step, the persisted step 5 and the last one; no carriage returns or escapes.
    assert [line.split("|")[0].strip() for line in lines[1:]] == [
        "step  4/10",
        "step  5/10",
        "step  8/10",
        "step 10/10",
    ]
    assert lines[1].startswith("step  4/10 | reward 0.400 | gen 100 tok/s | eta ")
    assert lines[-1].endswith("eta 0s")
    assert "\r" not in stream.getvalue() and "\x1b" not in stream.getvalue()


def test_a_bar_with_eta_on_a_terminal():
    leader, follower = pty.openpty()
    # A terminal 120 columns wide (a fresh pty has 0, and the bar would be cut to nothing).
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    try:
        with os.fdopen(follower, "w") as terminal:
            progress = Progress(5, desc="sft", stream=terminal)
            assert progress.is_bar
            for step in range(1, 6):
                progress.update(step, {"loss": f"{1 / step:.4f}"}, persist=step == 3)
            progress.close()
        output = read_all(leader)
    finally:
        os.close(leader)
    assert "\r" in output  # the bar redraws in place
    assert "sft: 100%" in output and "5/5" in output and "loss 0.2000" in output
    assert "<00:00" in output  # tqdm's elapsed<remaining (ETA)
    # The persisted step is a line of its own above the bar.
    assert any(line.strip("\r").startswith("step 3/5 | loss 0.3333") for line in output.splitlines())


def read_all(leader: int) -> str:
    """Everything written to a pty whose follower side is closed.

    One read returns only what the pty has passed on so far (a CI run saw the bar cut at
    step 2 of 5); reading until the closed follower gives EIO gets all of it.
    """
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # EIO: the follower is closed and everything was read
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()


def test_format_duration():
    assert [format_duration(s) for s in (5, 65, 3725)] == ["5s", "1m05s", "1h02m"]
