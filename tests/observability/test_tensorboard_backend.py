"""The TensorBoard backend on a resumed run: what the stopped run logged after the checkpoint
is hidden, as the JSONL backend drops those rows, and the resumed run's values replace it."""

import pytest

from forge.observability.backends import TensorBoardBackend

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def scalars(log_dir, tag: str) -> list[tuple[int, float]]:
    events = event_accumulator.EventAccumulator(str(log_dir))
    events.Reload()
    if tag not in events.Tags()["scalars"]:
        return []
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_a_resumed_run_hides_the_steps_after_its_checkpoint(tmp_path):
    # The stopped run got to step 6, evaluated there, and had saved its checkpoint at step 4.
    stopped = TensorBoardBackend(tmp_path)
    for step in range(1, 7):
        stopped.log(step, {"loss": float(step), **({"eval/accuracy": 0.5} if step == 6 else {})})
    stopped.close()
    # The resumed run logs steps 5 and 6 again (its eval comes later).
    resumed = TensorBoardBackend(tmp_path)
    for step in (5, 6):
        resumed.log(step, {"loss": 10.0 * step})
    resumed.close()

    assert scalars(tmp_path, "loss") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 50.0), (6, 60.0)]
    assert scalars(tmp_path, "eval/accuracy") == []
