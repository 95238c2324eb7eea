"""Replay-buffer logic and the PolicyBatch it builds from episodes, in one process."""

import pickle

import pytest

from forge.data.types import Completion, Episode
from forge.observability.collector import pop_state
from forge.replay_buffer import EpisodeBuffer, ReplayBufferConfig
from forge.rl.batch import PolicyBatch, response_rows


def episode(version: int, prompt=(1, 5, 6), response=(7, 8, 2), advantage=0.5, ref=None) -> Episode:
    completion = Completion(
        prompt="p",
        prompt_ids=list(prompt),
        response_ids=list(response),
        logprobs=[-0.1 * (i + 1) for i in range(len(response))],
        text="r",
        stop_reason="stop",
        policy_version=version,
    )
    return Episode(completion, target="t", group_id="g", advantage=advantage, ref_logprobs=ref)


def test_policy_batch_places_response_tokens_and_logprobs_at_the_shifted_positions():
    a = episode(3, prompt=(1, 5, 6), response=(7, 8, 2), ref=[-1.0, -2.0, -3.0])
    b = episode(4, prompt=(1, 9), response=(4,), advantage=-1.0, ref=[-4.0])
    batch = PolicyBatch.from_episodes([a, b], pad_id=0)
    # Row a: sequence 1 5 6 7 8 2 -> tokens 1 5 6 7 8, targets 5 6 7 8 2, response targets at 2..4.
    assert batch.tokens.tolist() == [[1, 5, 6, 7, 8], [1, 9, 0, 0, 0]]
    assert batch.target_ids.tolist() == [[5, 6, 7, 8, 2], [9, 4, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    assert batch.generator_logprobs[0, 2:].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert batch.ref_logprobs[1].tolist() == [0.0, -4.0, 0.0, 0.0, 0.0]
    assert batch.advantages.tolist() == [0.5, -1.0]
    assert batch.policy_versions.tolist() == [3, 4]
    # Every masked target is a response token, in order, and the rows come back out per episode.
    for row, ep in enumerate([a, b]):
        masked = batch.target_ids[row][batch.loss_mask[row].bool()].tolist()
        assert masked == ep.completion.response_ids
    assert response_rows(batch.ref_logprobs, batch.loss_mask) == [[-1.0, -2.0, -3.0], [-4.0]]


def test_policy_batch_takes_per_token_advantages_when_an_episode_has_them():
    """Per-token advantages sit at the response targets; an episode without them repeats its
    sequence advantage there (a batch where none has them keeps one per sequence, above)."""
    a = episode(0, prompt=(1, 5, 6), response=(7, 8, 2), advantage=9.0)
    a.token_advantages = [0.5, -0.25, 2.0]
    b = episode(0, prompt=(1, 9), response=(4, 3), advantage=-1.0)
    batch = PolicyBatch.from_episodes([a, b], pad_id=0)
    assert batch.advantages.tolist() == [[0.0, 0.0, 0.5, -0.25, 2.0], [0.0, -1.0, -1.0, 0.0, 0.0]]
    assert [h.advantages.shape for h in batch.split(1)] == [(1, 5), (1, 5)]
    a.token_advantages = [0.5]
    with pytest.raises(ValueError, match=r"one value per response token.*\[1, 2\].*\[3, 2\]"):
        PolicyBatch.from_episodes([a, b], pad_id=0)


def test_policy_batch_without_reference_leaves_ref_logprobs_none():
    batch = PolicyBatch.from_episodes([episode(0), episode(0, ref=[0.0, 0.0, 0.0])], pad_id=0)
    assert batch.ref_logprobs is None


def test_policy_batch_rejects_reference_rows_of_the_wrong_length():
    with pytest.raises(ValueError, match=r"one value per response token.*\[2\].*\[3\]"):
        PolicyBatch.from_episodes([episode(0, ref=[0.0, 0.0])], pad_id=0)


def test_policy_batch_splits_moves_and_pickles():
    episodes = [episode(v, response=(7,) * (v + 1), advantage=float(v)) for v in range(4)]
    batch = PolicyBatch.from_episodes(episodes, pad_id=0)
    halves = batch.split(2)
    assert [h.advantages.tolist() for h in halves] == [[0.0, 1.0], [2.0, 3.0]]
    assert [h.policy_versions.tolist() for h in halves] == [[0, 1], [2, 3]]
    assert all(h.tokens.shape == (2, batch.tokens.shape[1]) and h.ref_logprobs is None for h in halves)
    moved = pickle.loads(pickle.dumps(batch.to("meta")))
    assert moved.tokens.device.type == "meta" and moved.loss_mask.shape == batch.loss_mask.shape


def test_sample_evicts_stale_episodes_counts_them_and_splits_per_rank():
    pop_state()
    buffer = EpisodeBuffer(ReplayBufferConfig(batch_size=4, max_policy_age=1, seed=3), dp_size=2)
    for v in (0, 0, 1, 1, 2, 2, 2):
        buffer.add(episode(v))
    assert buffer.sample(curr_policy_version=2) is not None  # ages 0..2: the two v0 are evicted
    state = pop_state()
    assert state["buffer/evicted_stale"].value() == 2
    assert state["buffer/policy_age_max"].value() <= 1
    assert len(buffer) == 1  # 5 fresh, 4 sampled: each episode is trained on at most once


def test_sample_takes_the_oldest_episodes_first_then_in_arrival_order():
    """The staleness bound plans each rollout for the step after the episodes ahead of it; an
    older episode passed over for a newer one would go stale before its step comes."""
    buffer = EpisodeBuffer(ReplayBufferConfig(batch_size=2, max_policy_age=5))
    for i, v in enumerate((2, 1, 0, 1, 0, 1)):
        buffer.add(episode(v, advantage=float(i)))
    batches = [buffer.sample(2)[0] for _ in range(3)]
    assert [sorted(e.advantage for e in b) for b in batches] == [[2.0, 4.0], [1.0, 3.0], [0.0, 5.0]]
    assert buffer.counts["evicted_stale"] == 0


def test_sample_returns_none_until_a_full_batch_is_fresh():
    buffer = EpisodeBuffer(ReplayBufferConfig(batch_size=2, max_policy_age=0))
    buffer.add(episode(0))
    assert buffer.sample(0) is None
    buffer.add(episode(0))
    per_rank = buffer.sample(0)
    assert [len(r) for r in per_rank] == [2]
    buffer.add(episode(0))
    buffer.add(episode(0))
    assert buffer.sample(1) is None and len(buffer) == 0  # too old for max_policy_age=0


def test_state_dict_round_trip_gives_the_same_samples():
    first = EpisodeBuffer(ReplayBufferConfig(batch_size=2, max_policy_age=5, seed=1))
    for i in range(6):
        first.add(episode(0, advantage=float(i)))
    second = EpisodeBuffer(ReplayBufferConfig(batch_size=2, max_policy_age=5, seed=99))
    second.load_state_dict(first.state_dict())
    for _ in range(3):
        a, b = first.sample(0), second.sample(0)
        assert [e.advantage for e in a[0]] == [e.advantage for e in b[0]]


def test_a_full_buffer_asks_rollouts_to_wait_and_keeps_every_episode():
    buffer = EpisodeBuffer(ReplayBufferConfig(batch_size=2, max_size=2, max_policy_age=5))
    buffer.add(episode(0))
    assert buffer.has_room()
    buffer.add(episode(0))
    assert not buffer.has_room()
    buffer.add(episode(0))  # a rollout that started while there was room still lands
    assert len(buffer) == 3 and buffer.counts["added"] == 3
    buffer.sample(0)
    assert buffer.has_room() and buffer.counts["sampled"] == 2


def test_episodes_the_trainer_made_stale_leave_room():
    # Full of version-0 episodes; once the trainer is at version 2 (max age 1) they can never be
    # trained on: asked with that version, the buffer evicts them instead of holding rollouts
    # back (the trainer, finding no fresh batch, would never sample them away).
    buffer = EpisodeBuffer(ReplayBufferConfig(batch_size=2, max_size=2, max_policy_age=1))
    buffer.add(episode(0))
    buffer.add(episode(0))
    assert not buffer.has_room() and not buffer.has_room(1)  # still fresh at version 1
    assert buffer.has_room(2)
    assert len(buffer) == 0 and buffer.counts["evicted_stale"] == 2


def test_max_size_must_hold_a_batch():
    with pytest.raises(ValueError, match=r"max_size \(2\) must be at least replay_buffer.batch_size \(4\)"):
        ReplayBufferConfig(batch_size=4, max_size=2)


def test_batch_size_must_split_across_ranks():
    with pytest.raises(ValueError, match="divisible by the trainer's data-parallel size 2"):
        EpisodeBuffer(ReplayBufferConfig(batch_size=3), dp_size=2)
