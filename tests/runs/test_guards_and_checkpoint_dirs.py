"""The skipped-update guard and which checkpoint directories count as complete (no actors)."""

import asyncio

import pytest

from forge.observability.collector import pop_state
from forge.runs import RunStopped
from forge.runs.checkpoint import RunCheckpointer
from forge.runs.guards import SkippedUpdates


def test_skipped_updates_are_counted_and_n_in_a_row_stop_the_run():
    pop_state()
    guard = SkippedUpdates(limit=2)
    guard.observe(1, {"train/skipped": 1.0})
    guard.observe(2, {"train/skipped": 0.0})  # a good step resets the count
    guard.observe(3, {"train/skipped": 1.0})
    with pytest.raises(RunStopped, match=r"step 4: 2 updates in a row were skipped .* loss nan"):
        guard.observe(4, {"train/skipped": 1.0, "train/loss": float("nan")})
    assert pop_state()["grpo/skipped_updates"].value() == 3


def test_only_renamed_checkpoints_with_their_run_state_are_complete(tmp_path):
    for name, complete in (("step_00000002", True), ("step_00000010", True), ("step_00000012.tmp", True)):
        (tmp_path / name / "trainer").mkdir(parents=True)
        if complete:
            (tmp_path / name / "run_state.pt").write_bytes(b"")
    (tmp_path / "step_00000011" / "trainer").mkdir(parents=True)  # killed before its run state
    checkpoints = RunCheckpointer(tmp_path, keep=2)
    assert [p.name for p in checkpoints.complete()] == ["step_00000002", "step_00000010"]
    assert checkpoints.latest() == tmp_path / "step_00000010"
    checkpoints.check_start(resume=True)
    with pytest.raises(ValueError, match="newest: step_00000010\\): pass resume=true"):
        checkpoints.check_start(resume=False)
    RunCheckpointer(tmp_path / "fresh", keep=2).check_start(resume=False)


def test_a_checkpoint_waits_for_rollouts_in_flight_and_holds_new_ones():
    from forge.runs.checkpoint import RolloutPause

    async def run():
        pause, events = RolloutPause(), []

        async def rollout(name: str, seconds: float):
            async with pause.rollout():
                events.append(f"{name} start")
                await asyncio.sleep(seconds)
                events.append(f"{name} end")

        async def checkpoint():
            async with pause.paused():
                events.append("save")

        first = asyncio.create_task(rollout("a", 0.2))
        await asyncio.sleep(0.05)
        saving = asyncio.create_task(checkpoint())
        await asyncio.sleep(0)
        second = asyncio.create_task(rollout("b", 0.0))
        await asyncio.gather(first, saving, second)
        assert events == ["a start", "a end", "save", "b start", "b end"]

    asyncio.run(run())
