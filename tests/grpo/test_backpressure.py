"""The replay buffer's backpressure and a starving trainer, against real buffer and reward actors."""

import asyncio

import pytest

from forge.actors.replay_buffer import ReplayBuffer
from forge.actors.reward import RewardActor, RewardConfig
from forge.controller import shutdown
from forge.data.types import Completion, Episode
from forge.observability.collector import pop_state
from forge.replay_buffer import ReplayBufferConfig
from forge.rewards.sources import RewardFunctions, RolloutScorer
from forge.rollout.step import RolloutCounts, wait_for_room
from forge.runs import RunStopped
from forge.runs.guards import starvation_report, wait_for_batch

pytestmark = pytest.mark.slow


def episode(version: int = 0) -> Episode:
    completion = Completion(
        prompt="p",
        prompt_ids=[1, 5],
        response_ids=[7, 2],
        logprobs=[-0.1, -0.2],
        text="r",
        stop_reason="stop",
        policy_version=version,
    )
    return Episode(completion, target="t", group_id="g", advantage=0.5)


async def never_a_batch(buffer):
    # The trainer is at version 1: the version-0 episodes are evicted as stale.
    while await buffer.sample.route(1) is None:
        await asyncio.sleep(0.05)


def test_a_full_buffer_makes_rollouts_wait_and_a_starving_trainer_stops_with_the_counts():
    async def run():
        config = ReplayBufferConfig(batch_size=2, max_size=2, max_policy_age=0)
        buffer = await ReplayBuffer.as_actor(config, 0)
        reward = await RewardActor.as_actor(RewardConfig(timeout_s=None))
        scorer = RolloutScorer([RewardFunctions.of(RewardConfig(), reward.evaluate_groups.route)])
        try:
            pop_state()
            await buffer.add_many.route([episode(), episode()])
            counts = RolloutCounts(groups=3, groups_skipped=2)
            waiting = asyncio.ensure_future(wait_for_room(buffer, counts))
            await asyncio.sleep(1.0)
            assert not waiting.done()  # full: the rollout waits, nothing is refused or dropped
            assert await buffer.sample.route(0) is not None
            await asyncio.wait_for(waiting, 30)
            assert counts.waits_for_room == 1
            assert pop_state()["rollout/wait_for_room_s"].value() >= 1.0

            # Two episodes of version 0 arrive, but the trainer is at version 1: both go stale.
            await buffer.add_many.route([episode(), episode()])
            with pytest.raises(RunStopped) as stopped:
                await wait_for_batch(
                    never_a_batch(buffer),
                    1.0,
                    lambda: starvation_report(counts, buffer, scorer, config),
                )
            message = str(stopped.value)
            assert "no batch for 1 s (replay_buffer.starve_timeout_s)" in message
            assert "3 groups generated, 2 skipped for no signal" in message
            assert "4 episodes added to the buffer, 2 evicted as stale" in message
            assert "2 trained on, 0 held (a batch needs 2); reward errors 0, reward timeouts 0" in message
        finally:
            await shutdown()

    asyncio.run(run())
