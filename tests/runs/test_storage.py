"""A run's output storage: a folder that cannot be written is refused before start-up, and a
full disk met mid-run stops the run naming the file (the app then names the checkpoint to
resume from). /dev/full is a real full disk: every write to it fails with ENOSPC."""

import os
from pathlib import Path

import pytest

from forge.data.types import Completion
from forge.observability.jsonl import JsonlAppender
from forge.rollout.records import RolloutRecorder
from forge.runs import ActorFailed, RunStopped
from forge.runs.storage import check_writable_dir, stop_on_storage_errors

FULL = "/dev/full"
needs_dev_full = pytest.mark.skipif(not os.path.exists(FULL), reason="needs /dev/full")


def test_a_writable_folder_is_created_and_left_without_the_probe(tmp_path):
    check_writable_dir(tmp_path / "a" / "run", "output_dir")
    assert list((tmp_path / "a" / "run").iterdir()) == []


def test_a_folder_that_cannot_be_created_is_named_with_its_key(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError) as error:
        check_writable_dir(tmp_path / "file" / "run", "output_dir")
    assert str(error.value).startswith(
        f"output_dir: cannot write to {tmp_path / 'file' / 'run'} (Not a directory)"
    )
    assert "or choose another output_dir" in str(error.value)


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs sysfs")
def test_a_folder_that_even_root_cannot_write_to():
    # sysfs takes no new files, whoever asks.
    with pytest.raises(ValueError, match=r"^run_dir: cannot write to /sys/kernel \(Permission denied\)"):
        check_writable_dir("/sys/kernel", "run_dir")


@needs_dev_full
def test_a_full_disk_stops_the_run_naming_the_file():
    appender = JsonlAppender(FULL)
    with pytest.raises(RunStopped) as stopped, stop_on_storage_errors("runs/demo"):
        appender.write({"step": 1})
    assert str(stopped.value).startswith(f"cannot write {FULL}: No space left on device.")
    appender.close()  # what could not be written is dropped: closing does not fail again


@needs_dev_full
def test_a_full_disk_under_the_rollout_recorder_is_raised_once():
    recorder = RolloutRecorder(FULL)
    recorder.record_eval(*_eval_answer())
    with (
        pytest.raises(RunStopped, match=f"cannot write {FULL}: No space left"),
        stop_on_storage_errors("runs/demo"),
    ):
        recorder.close()  # the background writer's failure, wrapped, is found by its cause
    recorder.close()  # raised once: the app's own close after the stop is quiet


def _eval_answer() -> tuple[list[Completion], list[str], list[float]]:
    return [Completion("1+1=", [1, 2], [3], [-0.5], "2", "stop", 0)], ["2"], [1.0]


@needs_dev_full
def test_a_full_disk_met_by_the_last_records_of_a_run_that_went_well_stops_it():
    with (
        pytest.raises(RunStopped, match=f"cannot write {FULL}: No space left"),
        stop_on_storage_errors("runs/demo"),
        RolloutRecorder(FULL) as recorder,
    ):
        recorder.record_eval(*_eval_answer())


@needs_dev_full
def test_the_recorder_closed_under_a_run_error_logs_its_own_and_keeps_that_error(caplog):
    # As the GRPO run's recorder closes after a checkpoint's full disk stopped the run first
    # (the fault-injection runs that ended in "writing rollout records ... failed").
    with (
        pytest.raises(ActorFailed, match="actor TitanTrainer died"),
        stop_on_storage_errors("runs/demo"),
        RolloutRecorder(FULL) as recorder,
    ):
        recorder.record_eval(*_eval_answer())
        raise ActorFailed("actor TitanTrainer died: killed")
    assert f"writing rollout records to {FULL} failed" in caplog.text
    assert "No space left on device" in caplog.text


@needs_dev_full
def test_a_stop_raised_while_a_full_disk_is_handled_keeps_its_reason():
    with pytest.raises(ActorFailed), stop_on_storage_errors("runs/demo"):
        try:
            with open(FULL, "wb", buffering=0) as f:
                f.write(b"x")
        except OSError:
            raise ActorFailed("actor TitanTrainer died: killed") from None  # a restart may heal it


@needs_dev_full
def test_a_write_error_without_a_file_name_names_the_output_dir():
    with open(FULL, "wb", buffering=0) as f, pytest.raises(RunStopped) as stopped:
        with stop_on_storage_errors("runs/demo"):
            f.write(b"x")  # as a checkpoint's file write fails: no file name in the error
    assert str(stopped.value).startswith(
        "cannot write the run's files in runs/demo: No space left on device."
    )


def test_other_errors_pass_through(tmp_path):
    with pytest.raises(FileNotFoundError), stop_on_storage_errors("runs/demo"):
        Path(tmp_path / "missing").read_text()
