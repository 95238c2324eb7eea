"""Metrics recorded in several processes reduce exactly, and reach the JSONL backend."""

import asyncio
import json
import math

import pytest
from monarch.actor import current_rank, endpoint

from forge.controller import ForgeActor, shutdown
from forge.observability import Accumulator, MetricsConfig, Reduce, get_metric_logger, record_metric
from forge.observability.backends import JsonlBackend, drop_metrics_after
from forge.observability.collector import pop_state


def values_for(rank: int, step: int) -> list[float]:
    # Different counts per process, so a mean of per-process means would be wrong.
    return [rank * 10.0 + step + i * 0.5 for i in range(3 + 2 * rank)]


class Recorder(ForgeActor):
    procs = 2

    @endpoint
    async def record(self, step: int) -> None:
        for v in values_for(current_rank().rank, step):
            for reduce in Reduce:
                record_metric(f"test/{reduce.value}", v, reduce)


def expected(values: list[float]) -> dict[str, float]:
    n = len(values)
    mean = sum(values) / n
    return {
        "test/mean": mean,
        "test/sum": sum(values),
        "test/max": max(values),
        "test/min": min(values),
        "test/std": math.sqrt(sum((v - mean) ** 2 for v in values) / n),
    }


def test_two_processes_and_the_caller_reduce_exactly(tmp_path):
    async def main():
        jsonl = tmp_path / "metrics.jsonl"
        # Recorded before the run configures its logger (e.g. by another use of the weight store):
        # not the run's, so not in its first row.
        record_metric("test/before_the_run", 1.0, Reduce.SUM)
        metric_logger = await get_metric_logger(MetricsConfig(console=False, jsonl_path=str(jsonl)))
        recorder = await Recorder.as_actor()
        rows = []
        for step in (1, 2):
            await recorder.record.route(step)
            caller_values = [100.0 + step]  # the controller process records too
            for v in caller_values:
                for reduce in Reduce:
                    record_metric(f"test/{reduce.value}", v, reduce)
            rows.append(await metric_logger.flush(step))
            all_values = values_for(0, step) + values_for(1, step) + caller_values
            for key, value in expected(all_values).items():
                assert rows[-1][key] == pytest.approx(value, rel=1e-12), key
        assert "test/before_the_run" not in rows[0]
        await metric_logger.close()
        written = [json.loads(line) for line in jsonl.read_text().splitlines()]
        assert [w["step"] for w in written] == [1, 2]
        assert written[1]["test/std"] == pytest.approx(rows[1]["test/std"])
        await Recorder.shutdown(recorder)
        await shutdown()

    asyncio.run(main())


def test_accumulators_merge_like_one_stream():
    values = [3.0, -1.5, 8.25, 0.0, 2.0, 2.0, 7.5]
    for reduce in Reduce:
        whole = Accumulator(reduce)
        for v in values:
            whole.add(v)
        left, right = Accumulator(reduce), Accumulator(reduce)
        for v in values[:3]:
            left.add(v)
        for v in values[3:]:
            right.add(v)
        left.merge(right)
        assert left.value() == pytest.approx(whole.value(), rel=1e-12)
        assert whole.value() == pytest.approx(expected(values)[f"test/{reduce.value}"], rel=1e-12)


def test_one_key_with_two_reductions_is_refused():
    record_metric("test/conflict", 1.0, Reduce.SUM)
    with pytest.raises(ValueError, match="test/conflict.*SUM.*MAX"):
        record_metric("test/conflict", 1.0, Reduce.MAX)
    assert pop_state()["test/conflict"].value() == 1.0


def test_console_backend_prints_whatever_the_root_logger_level(capsys):
    import logging

    from forge.observability import ConsoleBackend

    metrics_logger = logging.getLogger("forge.metrics")
    for handler in list(metrics_logger.handlers):  # a fresh backend, writing to this test's stdout
        metrics_logger.removeHandler(handler)
    root_level = logging.getLogger().level
    logging.getLogger().setLevel(logging.WARNING)  # as the apps configure it
    try:
        ConsoleBackend(keys=["loss/pg", "train/lr"]).log(3, {"loss/pg": 0.25, "train/lr": 3e-4, "other": 1.0})
        # An eval whose every row failed has no mean reward: nan prints, it does not stop the run.
        ConsoleBackend(keys=["eval/reward_mean"]).log(4, {"eval/reward_mean": float("nan")})
    finally:
        logging.getLogger().setLevel(root_level)
    assert capsys.readouterr().out == "step 3 | loss/pg=0.25 train/lr=0.0003\nstep 4 | eval/reward_mean=nan\n"


def test_rows_dropped_on_resume_while_the_file_is_open_and_later_rows_still_land(tmp_path):
    # A resumed GRPO run opens its metrics file, then drops the rows logged after its
    # checkpoint (a new file renamed over the old one): its next rows must reach the new file.
    path = tmp_path / "metrics.jsonl"
    backend = JsonlBackend(path)
    for step in (1, 2, 3):
        backend.log(step, {"loss": float(step)})
    drop_metrics_after(path, 2)
    backend.log(3, {"loss": 30.0})
    backend.log(4, {"loss": 40.0})
    backend.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
