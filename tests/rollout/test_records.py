"""The rollout recorder on its own: fields, sampling of groups, eval records, the writer thread."""

import json

import numpy
import pytest

from forge.data.types import Completion, Episode
from forge.recipes.grpo_replay import load_replay_batches
from forge.rollout.records import (
    RECORD_FIELDS,
    RolloutRecorder,
    batches_path,
    decode_floats,
    decode_ids,
    encode_floats,
    read_records,
)


def completion(prompt: str, text: str, version: int = 3) -> Completion:
    return Completion(prompt, [1, 2], [5, 6, 7], [-0.5, -0.25, -0.125], text, "stop", version)


def group(index: int, size: int = 3) -> list[Episode]:
    group_id = f"g{index}"
    return [
        Episode(
            completion(f"{index}+1=", f"{index + i}"),
            str(index + 1),
            group_id,
            reward=float(i == 1),
            reward_breakdown={"toy_task": float(i == 1)},
            advantage=i - 1.0,
            ref_logprobs=[-1.0, -1.0, -1.0],
        )
        for i in range(size)
    ]


def test_every_field_of_every_episode_and_eval_answer(tmp_path):
    path = tmp_path / "run" / "rollouts.jsonl"
    recorder = RolloutRecorder(path)
    recorder.step = 7
    groups = [group(0), group(1)]
    recorder.record_groups(groups)
    recorder.step = 8
    recorder.record_eval([completion("2+2=", "4", version=8)], ["4"], [1.0])
    recorder.close()

    records = list(read_records(path))
    assert len(records) == 7
    training, evals = records[:6], records[6:]
    for record, episode in zip(training, [e for g in groups for e in g], strict=True):
        assert tuple(record) == RECORD_FIELDS
        assert record["step"] == 7 and record["eval"] is False
        assert record["episode_id"] == episode.episode_id
        assert (
            record["completion"] == episode.completion.text and record["prompt"] == episode.completion.prompt
        )
        assert record["reward"] == episode.reward and record["advantage"] == episode.advantage
        assert record["reward_breakdown"] == episode.reward_breakdown
        assert (
            record["policy_version"] == 3 and record["response_len"] == 3 and record["stop_reason"] == "stop"
        )
        # float32, exact: these are float32 values (as every logprob the trainer reads)
        assert decode_floats(record["logprobs"]) == episode.completion.logprobs
        assert decode_floats(record["ref_logprobs"]) == episode.ref_logprobs
        assert decode_ids(record["prompt_ids"]) == [1, 2] and decode_ids(record["response_ids"]) == [5, 6, 7]
    assert evals == [
        {
            "step": 8,
            "policy_version": 8,
            "eval": True,
            "prompt": "2+2=",
            "completion": "4",
            "target": "4",
            "reward": 1.0,
            "response_len": 3,
            "stop_reason": "stop",
            # Every completion has turns: one model turn, all of it trained.
            "turns": [{"role": "assistant", "text": "4", "num_tokens": 3, "reward": 0.0}],
            "truncated": False,
            "response_mask": None,
        }
    ]
    assert batches_path(path) == tmp_path / "run" / "rollouts.batches.jsonl"


def test_rollouts_every_keeps_whole_groups(tmp_path):
    recorder = RolloutRecorder(tmp_path / "r.jsonl", every=3)
    for i in range(7):
        recorder.record_groups([group(i, size=2)])
    recorder.close()
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    assert [json.loads(line)["group_id"] for line in lines] == ["g0", "g0", "g3", "g3", "g6", "g6"]


def test_float32_encoding_round_trips():
    values = [-0.1, -2.5, -1e-8, float("-inf")]
    decoded = decode_floats(encode_floats(values))
    assert decoded[1] == -2.5 and decoded[3] == float("-inf")
    assert decoded == [float(numpy.float32(v)) for v in values]
    assert encode_floats(None) is None and decode_floats(None) is None


def test_replay_names_what_is_missing(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    recorder = RolloutRecorder(path, every=2)
    groups = [group(0), group(1)]
    recorder.record_groups(groups)
    recorder.close()
    with pytest.raises(FileNotFoundError, match="rollouts.batches.jsonl"):
        load_replay_batches(path)
    ids = [e.episode_id for e in groups[0] + groups[1]]  # group 1 was not recorded (every=2)
    batches_path(path).write_text(json.dumps({"policy_version": 0, "episode_ids": [ids]}) + "\n")
    with pytest.raises(ValueError, match="metrics.rollouts_every=1"):
        load_replay_batches(path)
    batches_path(path).write_text(json.dumps({"policy_version": 0, "episode_ids": [ids[:3]]}) + "\n")
    ((rebuilt,),) = load_replay_batches(path)
    assert [e.episode_id for e in rebuilt] == ids[:3]
    assert [e.completion.logprobs for e in rebuilt] == [e.completion.logprobs for e in groups[0]]
    assert [e.advantage for e in rebuilt] == [e.advantage for e in groups[0]]


def test_replay_regroups_a_batch_recorded_on_other_data_parallel_ranks():
    from forge.recipes.grpo_replay import regroup

    two_ranks = [group(0, 3), group(1, 3)]
    assert regroup(two_ranks, 2) is two_ranks
    (one,) = regroup(two_ranks, 1)
    assert [e.episode_id for e in one] == [e.episode_id for share in two_ranks for e in share]
    three = regroup(two_ranks, 3)
    assert [len(share) for share in three] == [2, 2, 2]
    assert [e.episode_id for share in three for e in share] == [e.episode_id for e in one]
    with pytest.raises(ValueError, match="6 episodes cannot be split over 4 data-parallel ranks"):
        regroup(two_ranks, 4)


def test_per_token_advantages_are_recorded_and_replayed_exactly(tmp_path):
    """An episode trained with per-token advantages records them (float32, exact) and replay
    rebuilds the batch the run trained on; an episode without them records no such field."""
    from forge.rl.batch import PolicyBatch

    path = tmp_path / "rollouts.jsonl"
    episodes = group(0, size=2)
    episodes[0].token_advantages = [0.75, -0.5, 0.125]
    recorder = RolloutRecorder(path)
    recorder.record_groups([episodes])
    recorder.close()
    with_tokens, without = read_records(path)
    assert tuple(with_tokens) == (*RECORD_FIELDS, "token_advantages") and tuple(without) == RECORD_FIELDS
    batches_path(path).write_text(
        json.dumps({"policy_version": 0, "episode_ids": [[e.episode_id for e in episodes]]}) + "\n"
    )
    ((rebuilt,),) = load_replay_batches(path)
    assert [e.token_advantages for e in rebuilt] == [[0.75, -0.5, 0.125], None]
    replayed, recorded = (PolicyBatch.from_episodes(es, pad_id=0) for es in (rebuilt, episodes))
    assert replayed.advantages.tolist() == recorded.advantages.tolist()


def test_a_critics_values_and_returns_are_recorded_and_replayed_exactly(tmp_path):
    """With a critic (PPO), every episode records the critic's values and GAE's returns (float32,
    exact), and replay rebuilds the batch the critic trained on."""
    from forge.rl.batch import PolicyBatch

    path = tmp_path / "rollouts.jsonl"
    episodes = group(0, size=2)
    for episode, (values, returns) in zip(
        episodes,
        [([0.5, -0.25, 1.5], [1.0, 0.75, 0.5]), ([0.125, 0.0, -2.0], [-1.0, -1.0, -1.0])],
        strict=True,
    ):
        episode.token_advantages, episode.values, episode.returns = [0.25, 0.5, 0.75], values, returns
    recorder = RolloutRecorder(path)
    recorder.record_groups([episodes])
    recorder.close()
    assert all(tuple(r)[-3:] == ("token_advantages", "values", "returns") for r in read_records(path))
    batches_path(path).write_text(
        json.dumps({"policy_version": 0, "episode_ids": [[e.episode_id for e in episodes]]}) + "\n"
    )
    ((rebuilt,),) = load_replay_batches(path)
    assert [(e.values, e.returns) for e in rebuilt] == [(e.values, e.returns) for e in episodes]
    replayed, recorded = (PolicyBatch.from_episodes(es, pad_id=0) for es in (rebuilt, episodes))
    assert replayed.values.tolist() == recorded.values.tolist() and replayed.values.abs().sum() > 0
    assert replayed.returns.tolist() == recorded.returns.tolist()
