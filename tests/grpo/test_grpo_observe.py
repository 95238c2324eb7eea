"""Seeing what a GRPO run does: metrics rows from step 0, rollout records, forge.inspect,
forge.plot, and the two debug modes (replay of recorded batches, rollouts without a trainer).

One real recorded run (every actor in its own process) is shared by the module.
"""

import asyncio
import gzip
import json

import pytest
from apps.grpo.main import main
from transformers import AutoTokenizer

from forge import inspect as forge_inspect
from forge import store
from forge.actors.advantages import ComputeAdvantages
from forge.actors.dataset import DatasetActor
from forge.actors.generator import Generator, GeneratorConfig
from forge.actors.replay_buffer import ReplayBuffer
from forge.actors.reward import RewardActor, RewardConfig
from forge.controller import shutdown
from forge.data.chat_prompts import PromptRenderer
from forge.data.prompts import PromptDataConfig
from forge.envs.turns import TurnRenderer
from forge.observability import MetricsConfig, get_metric_logger
from forge.plot import plot_run
from forge.replay_buffer import ReplayBufferConfig
from forge.rewards.sources import RewardFunctions, RolloutScorer
from forge.rollout.records import (
    RECORD_FIELDS,
    RolloutRecorder,
    batches_path,
    decode_floats,
    decode_ids,
    read_records,
)
from forge.rollout.step import Rollouts, rollout_step

pytestmark = pytest.mark.slow

LOSS_KEYS = ("train/loss", "loss/pg", "loss/kl", "loss/ratio_mean", "loss/mismatch_kl", "train/grad_norm")


def metric_rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def recorded_run(grpo_config_factory):
    config = grpo_config_factory()
    history = main(["--config", str(config), "trainer.profile_step=2"])
    return config.parent / "run", history


def test_the_trainer_profile_covers_its_step_and_the_publish_after_it(recorded_run):
    run_dir, _ = recorded_run
    table = (run_dir / "profile" / "trainer_rank0_step2.txt").read_text()
    ranges = dict(line.split()[:2] for line in table.splitlines() if line.startswith("  forge."))
    # The window is step 2 and what the trainer did until step 3 began: the publish of version 2.
    assert set(ranges) == {"forge.train_step", "forge.push_weights"}
    assert float(ranges["forge.train_step"]) > 0
    assert "aten::mm" in table  # the engine's operators, recorded on the profiler's thread
    with gzip.open(run_dir / "profile" / "trainer_rank0_step2.json.gz") as trace:
        assert json.load(trace)["traceEvents"]
    assert not (run_dir / "profile" / "trainer_rank0_step1.txt").exists()


def test_the_step_rows_say_how_long_the_rollouts_stages_took(recorded_run):
    # What a generator replica waits for between two rollouts of a loop is that loop's scoring
    # and buffer calls: the stages are timed apart, each in the row of the step it ended in (a
    # step that no rollout stage ended in has none).
    run_dir, _ = recorded_run
    rows = metric_rows(run_dir)[1:]
    for stage in ("trajectories", "score", "add"):
        seconds = [row[f"rollout/{stage}_s"] for row in rows if f"rollout/{stage}_s" in row]
        assert seconds and all(s > 0 for s in seconds), (stage, rows)
    # And the wait for the staleness bound's room.
    waits = [row["rollout/wait_for_slot_s"] for row in rows if "rollout/wait_for_slot_s" in row]
    assert waits and all(w >= 0 for w in waits)


def test_every_eval_from_step_0_is_a_metrics_row_with_wall_time(recorded_run):
    run_dir, history = recorded_run
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [(r["step"], r["eval/accuracy"]) for r in rows] == history["eval_accuracy"]
    # The mean eval reward is that of the step's recorded eval answers.
    answers = [r for r in read_records(run_dir / "rollouts.jsonl") if r["eval"]]
    for row in rows:
        rewards = [a["reward"] for a in answers if a["step"] == row["step"]]
        assert rewards and row["eval/reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    times = [r["time"] for r in rows]
    assert times == sorted(times) and times[-1] - times[0] > 0


def test_rollout_records_of_the_run(recorded_run):
    run_dir, _ = recorded_run
    records = list(read_records(run_dir / "rollouts.jsonl"))
    training = {r["episode_id"]: r for r in records if not r["eval"]}
    for record in training.values():
        assert tuple(record) == RECORD_FIELDS
        assert (
            record["response_len"]
            == len(decode_ids(record["response_ids"]))
            == len(decode_floats(record["logprobs"]))
        )
        assert record["reward_breakdown"] == {"toy_task": record["reward"]}
        assert len(decode_floats(record["ref_logprobs"])) == record["response_len"]
        assert record["stop_reason"] in ("stop", "length") and 0 <= record["step"] <= 3
    # Every trained episode was recorded when it entered the buffer, with its policy version.
    batches = list(read_records(batches_path(run_dir / "rollouts.jsonl")))
    assert len(batches) == 3
    for batch in batches:
        (ids,) = batch["episode_ids"]  # one data-parallel rank
        assert len(ids) == 8 and all(i in training for i in ids)
        assert all(batch["policy_version"] - training[i]["policy_version"] <= 1 for i in ids)
    # The greedy evals of steps 0..3, 8 prompts each, answered by the policy of that step.
    evals = [r for r in records if r["eval"]]
    assert [r["step"] for r in evals] == [s for s in range(4) for _ in range(8)]
    assert all(r["policy_version"] == r["step"] for r in evals)


def test_inspect_prints_a_table(recorded_run, capsys):
    run_dir, _ = recorded_run
    forge_inspect.main([str(run_dir), "--worst", "2", "--best", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert "training episodes, steps" in lines[0] and lines[0].endswith("showing 3")
    assert lines[1].split()[:7] == ["step", "ver", "reward", "adv", "len", "turns", "stop"]
    rewards = [float(line.split()[2]) for line in lines[2:]]
    assert len(rewards) == 3 and rewards[0] <= rewards[1] <= rewards[2]

    forge_inspect.main([str(run_dir), "--eval", "--step", "0", "--limit", "5"])
    lines = capsys.readouterr().out.splitlines()
    assert "32 eval answers" in lines[0] and len(lines) == 2 + 5
    assert all(line.split()[:2] == ["0", "0"] for line in lines[2:])


def test_plot_writes_the_figures(recorded_run):
    run_dir, _ = recorded_run
    written = plot_run(run_dir)
    assert sorted(p.name for p in written) == ["loss.png", "reward.png", "system.png"]
    for path in written:
        assert path.parent == run_dir / "plots"
        data = path.read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000


def test_replay_reproduces_the_recorded_losses(recorded_run, tmp_path):
    run_dir, _ = recorded_run
    history = main(
        [
            "--config",
            str(run_dir / "config.yaml"),
            f"rollout.replay_from={run_dir / 'rollouts.jsonl'}",
            f"output_dir={tmp_path}",
            f"metrics.jsonl_path={tmp_path}/metrics.jsonl",
        ]
    )
    assert history["replayed_steps"] == 3
    recorded = {r["step"]: r for r in metric_rows(run_dir)}
    replayed = metric_rows(tmp_path)
    assert [r["step"] for r in replayed] == [1, 2, 3]
    for row in replayed:
        for key in LOSS_KEYS:  # the same batches through the same trainer: bit for bit
            assert row[key] == recorded[row["step"]][key], (row["step"], key)
    assert not (tmp_path / "rollouts.jsonl").exists()


def test_rollout_only_mode_generates_and_records(grpo_config_factory):
    config = grpo_config_factory()
    history = main(["--config", str(config), "trainer.enabled=false", "max_steps=2", "eval.every=0"])
    run_dir = config.parent / "run"
    assert history["eval_accuracy"] == []  # eval.every=0: no eval at all
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and "train/loss" not in rows[-1]
    assert not any("eval/accuracy" in r for r in rows)
    records = [r for r in read_records(run_dir / "rollouts.jsonl") if not r["eval"]]
    assert len(records) >= 16 and {r["policy_version"] for r in records} == {0}


def test_records_match_the_buffer_episode_for_episode(tiny_policy, tmp_path):
    """Counts and fields against the buffer's own, through the real rollout step and actors."""

    async def run() -> None:
        metric_logger = await get_metric_logger(MetricsConfig(console=False))
        await store.initialize()  # the generator looks for newer weights before each request
        dataset, generator, reward, advantages, buffer = await asyncio.gather(
            DatasetActor.as_actor(PromptDataConfig(toy_task={"num_train": 50, "num_eval": 5})),
            Generator.as_actor(GeneratorConfig(model_path=str(tiny_policy), sampling={"max_tokens": 4})),
            RewardActor.as_actor(RewardConfig()),
            ComputeAdvantages.as_actor("grpo"),
            ReplayBuffer.as_actor(ReplayBufferConfig(batch_size=4), 0),
        )
        try:
            recorder = RolloutRecorder(tmp_path / "rollouts.jsonl")
            functions = RewardFunctions.of(RewardConfig(), reward.evaluate_groups.route)
            scorer = RolloutScorer([functions])
            renderer = TurnRenderer(PromptRenderer(AutoTokenizer.from_pretrained(tiny_policy)))
            added: list[int] = []  # policy versions of the episodes added
            for step in range(3):
                recorder.step = step
                added += await rollout_step(
                    dataset=dataset,
                    rollouts=Rollouts(generator, renderer, max_tokens=4),
                    scorer=scorer,
                    advantages=advantages,
                    reference=None,
                    replay_buffer=buffer,
                    prompts_per_step=2,
                    group_size=3,
                    skip_groups_without_signal=False,
                    recorder=recorder,
                )
            recorder.close()
            buffered = (await buffer.state_dict.route())["episodes"]
            row = await metric_logger.flush(1)
        finally:
            await store.shutdown()
            await shutdown()
        records = list(read_records(tmp_path / "rollouts.jsonl"))
        assert len(records) == len(buffered) == len(added) == row["buffer/added"] == 3 * 2 * 3
        for record, episode in zip(records, buffered, strict=True):
            assert record["episode_id"] == episode.episode_id
            assert record["completion"] == episode.completion.text
            assert record["reward"] == episode.reward and record["advantage"] == episode.advantage
            assert decode_ids(record["response_ids"]) == episode.completion.response_ids
            assert decode_floats(record["logprobs"]) == episode.completion.logprobs

    asyncio.run(run())
