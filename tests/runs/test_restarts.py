"""The restart supervisor (forge.runs.restarts) around a real child process, and `resume`'s
refusals. The app's own restart (a SIGKILLed trainer) is in tests/grpo/test_grpo_durable.py."""

import json
import textwrap

import pytest

from forge.runs import restarts
from forge.runs.checkpoint import RunCheckpointer
from forge.runs.restarts import ACTOR_FAILED_EXIT, RESTARTS_ENV, run_with_restarts, starts_afresh

# A stand-in app: records its arguments and restart count, then exits with the status that
# `statuses` (a JSON list in the file beside it) gives its attempt.
APP = """
import json, os, sys
from pathlib import Path
here = Path(__file__).parent
attempt = int(os.environ["{env}"])
with open(here / "calls.jsonl", "a") as f:
    f.write(json.dumps({{"attempt": attempt, "argv": sys.argv[1:]}}) + "\\n")
statuses = json.loads((here / "statuses.json").read_text())
sys.exit(statuses[min(attempt, len(statuses) - 1)])
"""


@pytest.fixture
def app(tmp_path, monkeypatch):
    (tmp_path / "stand_in_app.py").write_text(textwrap.dedent(APP.format(env=RESTARTS_ENV)))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    waits = []
    monkeypatch.setattr(restarts.time, "sleep", waits.append)

    def run(statuses, max_restarts, checkpoint=None):
        (tmp_path / "statuses.json").write_text(json.dumps(statuses))
        code = run_with_restarts(
            "stand_in_app", ["--config", "x.yaml"], max_restarts, 1.5, lambda: checkpoint
        )
        calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
        return code, calls, waits

    return run


def test_an_actor_failure_restarts_with_resume_auto_and_a_doubling_back_off(app, capsys):
    code, calls, waits = app(
        [ACTOR_FAILED_EXIT, ACTOR_FAILED_EXIT, 0], max_restarts=3, checkpoint="ckpt/step_2"
    )
    assert code == 0
    assert [c["attempt"] for c in calls] == [0, 1, 2]
    assert calls[0]["argv"] == ["--config", "x.yaml", "max_restarts=0"]
    assert calls[1]["argv"] == calls[2]["argv"] == ["--config", "x.yaml", "max_restarts=0", "resume=auto"]
    assert waits == [1.5, 3.0]
    assert "restart 2 of 3 in 3 s, from ckpt/step_2" in capsys.readouterr().err


def test_it_gives_up_after_max_restarts(app, capsys):
    code, calls, _ = app([ACTOR_FAILED_EXIT], max_restarts=2)
    assert code == ACTOR_FAILED_EXIT and len(calls) == 3
    err = capsys.readouterr().err
    assert "from the beginning (no checkpoint yet)" in err and "gave up after 2 restart(s)" in err


@pytest.mark.parametrize("status", [1, 2, 130])
def test_other_stops_are_not_restarted(app, status):
    code, calls, waits = app([status], max_restarts=2)
    assert code == status and len(calls) == 1 and waits == []


def test_resume_true_needs_a_checkpoint_and_auto_does_not(tmp_path):
    checkpoints = RunCheckpointer(tmp_path / "checkpoints", keep=2)
    with pytest.raises(ValueError, match="holds no checkpoint to continue from: use resume=auto"):
        checkpoints.check_start(True)
    checkpoints.check_start("auto")
    checkpoints.check_start(False)


def test_ctrl_c_during_the_back_off_ends_the_invocation(app, monkeypatch, capsys):
    def interrupted(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(restarts.time, "sleep", interrupted)
    code, calls, _ = app([ACTOR_FAILED_EXIT], max_restarts=2)
    assert code == 130 and len(calls) == 1
    assert "interrupted before the restart" in capsys.readouterr().err


def test_a_restart_without_a_checkpoint_replaces_its_earlier_attempt(monkeypatch):
    assert starts_afresh(False, has_checkpoint=False) and not starts_afresh(True, has_checkpoint=True)
    assert starts_afresh("auto", has_checkpoint=False)  # a first attempt: earlier files are refused
    assert not starts_afresh("auto", has_checkpoint=True)
    monkeypatch.setenv(RESTARTS_ENV, "1")
    assert not starts_afresh("auto", has_checkpoint=False)  # its rows are dropped and logged again
