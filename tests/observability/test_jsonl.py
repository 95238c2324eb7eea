"""A run's JSONL files after a kill mid-write: a cut last line is skipped with a warning by every
reader, a bad line elsewhere is an error naming file and line, and a resume's trim keeps what
came before it while the writers go on appending."""

import json
import logging

import pytest

from forge.observability.backends import JsonlBackend, drop_metrics_after
from forge.observability.jsonl import JsonlAppender, keep_rows, read_jsonl
from forge.observability.run_dir import read_metric_rows
from forge.recipes.grpo_replay import load_replay_batches
from forge.rollout.records import batches_path, read_records, trim_run_records


def write_cut(path, rows: list[dict], cut: str) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + cut)


@pytest.mark.parametrize("cut", ['{"step": 3, "loss"', '{"step": 3,\n', "\x00\x00"])
def test_a_cut_last_line_is_skipped_with_a_warning_naming_file_and_line(tmp_path, caplog, cut):
    path = tmp_path / "metrics.jsonl"
    write_cut(path, [{"step": 1}, {"step": 2}], cut)
    with caplog.at_level(logging.WARNING):
        assert list(read_jsonl(path)) == [{"step": 1}, {"step": 2}]
    assert f"{path}, line 3: cut short" in caplog.text


def test_a_bad_line_before_the_last_is_an_error_naming_file_and_line(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=rf"{path}, line 2: not a JSON object"):
        list(read_jsonl(path))


def test_every_reader_skips_a_cut_last_line(tmp_path, caplog):
    metrics = tmp_path / "metrics.jsonl"
    write_cut(metrics, [{"step": 0, "eval/accuracy": 0.5}, {"step": 1, "train/loss": 1.0}], '{"step": 2, "tr')
    assert [r["step"] for r in read_metric_rows(metrics)] == [0, 1]  # forge.plot's reader
    records = tmp_path / "rollouts.jsonl"
    write_cut(records, [{"step": 1, "eval": True, "reward": 1.0}], '{"step": 1, "eval": fa')
    assert len(list(read_records(records))) == 1  # forge.inspect's and replay's reader
    # Replay reads the batch records too: a cut last batch is one batch fewer, not an error.
    write_cut(batches_path(records), [{"policy_version": 0, "episode_ids": [[]]}], '{"policy_vers')
    assert load_replay_batches(records) == [[[]]]
    for path, line in ((metrics, 3), (records, 2), (batches_path(records), 2)):
        assert f"{path}, line {line}: cut short" in caplog.text


def test_a_resume_trims_then_the_writers_append(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    backend = JsonlBackend(metrics)  # open before the trim, as in a resumed run
    for step in range(5):
        backend.log(step, {"x": float(step)})
    with metrics.open("a") as f:
        f.write('{"step": 5, "x"')  # the kill
    drop_metrics_after(metrics, 2)
    backend.log(3, {"x": 30.0})
    backend.close()
    assert [(r["step"], r["x"]) for r in read_jsonl(metrics)] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]

    records = tmp_path / "rollouts.jsonl"
    batches = JsonlAppender(batches_path(records))
    for step in range(1, 5):
        batches.write({"episode_ids": [[f"e{step}"]]})
    records.write_text("".join(json.dumps({"step": s, "eval": False}) + "\n" for s in (0, 1, 1, 2, 3, 4)))
    trim_run_records(records, 2)
    batches.write({"episode_ids": [["again3"]]})
    batches.close()
    assert [r["step"] for r in read_records(records)] == [0, 1, 1, 2]
    assert [r["episode_ids"] for r in read_jsonl(batches_path(records))] == [[["e1"]], [["e2"]], [["again3"]]]


def test_keep_rows_of_a_missing_file_is_nothing(tmp_path):
    assert keep_rows(tmp_path / "none.jsonl", lambda i, r: True) == 0


def test_non_finite_metrics_are_written_as_null_and_counted(tmp_path):
    path = tmp_path / "metrics.jsonl"
    backend = JsonlBackend(path)
    backend.log(1, {"loss": float("nan"), "grad": float("inf"), "lr": 0.1})
    backend.close()
    [row] = list(read_jsonl(path))  # strict JSON: json.loads accepts NaN, so check the text too
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()
    assert (row["loss"], row["grad"], row["lr"], row["metrics/non_finite"]) == (None, None, 0.1, 2)
