"""StalenessBound: rollouts start only while their episodes can still be trained on."""

import asyncio

import pytest

from forge.staleness import RolloutSlot, StalenessBound


async def _blocked(coroutine) -> asyncio.Task:
    task = asyncio.create_task(coroutine)
    await asyncio.sleep(0.01)
    assert not task.done(), "expected to wait"
    return task


def test_lockstep_with_max_policy_age_zero():
    async def main():
        bound = StalenessBound(max_policy_age=0, batch_size=8)
        first = await bound.start_rollout(8, group_size=2)
        assert first == RolloutSlot(0, 8)
        # 8 episodes in flight cover the next batch: a second rollout waits.
        second = await _blocked(bound.start_rollout(8, group_size=2))
        batch = await _blocked(bound.wait_for_batch())
        await bound.finish_rollout(first, [0] * 6)  # a group had no signal
        # On-policy, a rollout stays whole (as the serial recipe's) however few the batch lacks.
        assert await second == RolloutSlot(0, 8) and not batch.done()
        await bound.finish_rollout(await second, [0] * 6)
        await batch
        third = await _blocked(bound.start_rollout(8, group_size=2))  # 12 buffered: enough until trained
        await bound.trained([0] * 8)
        # The 4 left over are now too old; the next rollout must use version 1.
        assert await third == RolloutSlot(1, 8) and bound.buffered() == 0

    asyncio.run(main())


def test_one_step_of_staleness_keeps_two_batches_coming():
    async def main():
        bound = StalenessBound(max_policy_age=1, batch_size=4)
        slots = [await bound.start_rollout(4), await bound.start_rollout(4)]
        assert slots == [(0, 4), (0, 4)]
        blocked = await _blocked(bound.start_rollout(4))
        await bound.finish_rollout(slots[0], [0] * 4)
        await bound.finish_rollout(slots[1], [0] * 3)
        assert await blocked == (0, 1)  # 7 buffered, 1 short of two batches
        await bound.finish_rollout(await blocked, [0])
        await bound.trained([0] * 4)
        # Version 0 episodes stay trainable for one more step, which they fill: a rollout now is
        # for the step after it, so it needs version 1.
        assert bound.buffered() == 4 and bound.min_rollout_version == 1
        await bound.trained([0] * 4)
        assert bound.buffered() == 0 and bound.min_rollout_version == 1
        # Episodes that arrive already too old are not counted (the buffer evicts them).
        await bound.finish_rollout(await bound.start_rollout(4), [0, 0, 2, 2])
        assert bound.buffered() == 2


def test_a_rollout_needs_the_version_of_the_step_that_will_train_it():
    """Episodes ahead of a rollout push it to a later step: a rollout started on the policy of
    now would be too old by the time that step comes, however new its last tokens are."""

    async def main():
        bound = StalenessBound(max_policy_age=1, batch_size=4)
        first, second = await bound.start_rollout(4), await bound.start_rollout(4)
        assert first == (0, 4)  # trained by step 0 (starts from version 0)
        assert second == (0, 4)  # by step 1: version 0 is still fresh then
        await bound.finish_rollout(first, [0] * 4)
        await bound.finish_rollout(second, [0] * 4)
        await bound.trained([0] * 4)
        await bound.trained([0] * 4)
        await bound.start_rollout(4)
        assert bound.min_rollout_version == 2  # with 4 in flight: the next one is for step 3
        bound.max_policy_age = 2
        assert bound.min_rollout_version == 1

    asyncio.run(main())


@pytest.mark.parametrize("age", [0, 2])
def test_a_failed_rollout_releases_its_reservation(age):
    async def main():
        bound = StalenessBound(max_policy_age=age, batch_size=4)
        failed = await bound.start_rollout(4 * (age + 1))
        waiting = await _blocked(bound.start_rollout(4))
        await bound.finish_rollout(failed, [])
        await waiting

    asyncio.run(main())


@pytest.mark.parametrize("replicas", [2, 4])
def test_a_rollout_slot_frees_only_when_a_step_has_trained_so_replicas_need_one_of_slack(replicas):
    """One whole-batch rollout for each generator replica (forge.runs.placement's
    `idle_replicas_line`): when max_policy_age lets exactly that many be made ahead, a replica
    whose rollout ends may start its next only once the trainer has trained a batch, and then on
    the version just trained. One rollout of slack lets it start at once, on the policy it has."""

    async def main():
        tight = StalenessBound(max_policy_age=replicas - 1, batch_size=4)
        slots = [await tight.start_rollout(4) for _ in range(replicas)]
        assert slots == [(0, 4)] * replicas
        await tight.finish_rollout(slots[0], [0] * 4)  # the first replica's rollout ends
        next_rollout = await _blocked(tight.start_rollout(4))
        await tight.wait_for_batch()  # the trainer takes the batch...
        await asyncio.sleep(0.01)
        assert not next_rollout.done()  # ...and the replica still waits, for the step to end
        await tight.trained([0] * 4)
        assert await next_rollout == (1, 4)  # the version the step just made

        roomy = StalenessBound(max_policy_age=replicas, batch_size=4)
        slots = [await roomy.start_rollout(4) for _ in range(replicas)]
        await roomy.finish_rollout(slots[0], [0] * 4)
        assert await asyncio.wait_for(roomy.start_rollout(4), 1) == (0, 4)

    asyncio.run(main())


def test_a_step_waits_for_a_rollout_in_flight_that_it_is_the_last_to_be_able_to_train():
    """Rollouts end out of order. The step that is the last able to train a rollout still in
    flight waits for it rather than train a later rollout's batch, which would leave the earlier
    one too old for any step (its tokens generated in vain)."""

    async def main():
        bound = StalenessBound(max_policy_age=1, batch_size=4)
        early, late = await bound.start_rollout(4), await bound.start_rollout(4)
        assert early == late == (0, 4)  # planned for steps 0 and 1, on version 0
        await bound.finish_rollout(late, [0] * 4)  # the later one ends first
        await bound.wait_for_batch()  # step 0: version 0 is fresh at step 1 too, so no wait
        await bound.trained([0] * 4)
        third = await bound.start_rollout(4)
        assert third == (1, 4)
        await bound.finish_rollout(third, [1] * 4)
        # Step 1 is the last that can train `early`: it waits although a batch is buffered, and
        # a starving trainer's report would say so.
        batch = await _blocked(bound.wait_for_batch())
        assert (
            "the next step is the last able to train it (replay_buffer.max_policy_age=1)" in bound.due_line()
        )
        await bound.finish_rollout(early, [0] * 4)
        await asyncio.wait_for(batch, 1)
        assert bound.buffered() == 8 and bound.due_line() is None

    asyncio.run(main())
