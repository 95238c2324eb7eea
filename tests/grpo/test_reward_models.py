"""Reward models as services (forge.actors.reward_models): a rollout's responses reach each model
in batched calls, a judge's answers are kept, and a replica that dies or hangs is replaced with
its call retried; a lone model that hangs scores error_reward, counted, and the rollout goes on."""

import asyncio
import json
import os
import signal

import pytest
from apps.grpo.main import main
from processes import children_left
from reward_checkpoints import make_classifier

from forge.actors.reward import RewardConfig
from forge.actors.reward_models import ClassifierRewardModel, ServiceModel, launch_reward_models
from forge.config import load_config
from forge.controller import ProvisionerConfig, init_provisioner, shutdown
from forge.data.types import Completion
from forge.engines.reward_classifier import ClassifierRewardEngine
from forge.grpo.config import GRPOConfig
from forge.recipes.grpo_serial import grpo_serial
from forge.replay_buffer import ReplayBufferConfig
from forge.rewards.failures import Failure
from forge.rewards.judge import JudgeParse
from forge.rewards.sources import RewardFunctions, RewardModel, RolloutScorer
from forge.rollout.records import read_records
from forge.rollout.step import RolloutCounts
from forge.runs.checks import check_reward_models
from forge.runs.guards import starvation_report

pytestmark = pytest.mark.slow

PROMPTS = [["1+1=", "1+1=", "1+1=", "1+1="], ["2+5=", "2+5=", "2+5=", "2+5="]]
ANSWERS = [["2", "3", "11", "2<eos>"], ["7", "25", "0", "7"]]
TARGETS = ["2", "7"]
ERROR_REWARD = -1.0


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return make_classifier(tmp_path_factory.mktemp("rm"))


def expected_scores(classifier) -> list[float]:
    engine = ClassifierRewardEngine(str(classifier))
    return engine.score([p for g in PROMPTS for p in g], [a for g in ANSWERS for a in g])


def reward_config(classifier, judge=None, **classifier_settings) -> RewardConfig:
    models = [{"name": "rm", "path": str(classifier), "kind": "classifier", **classifier_settings}]
    if judge is not None:
        models.append(
            {
                "name": "judge",
                "path": str(judge),
                "kind": "judge",
                "engine": "hf",
                "sampling": {"max_tokens": 6},
            }
        )
    return RewardConfig.model_validate({"error_reward": ERROR_REWARD, "models": models})


def flat_values(scored, name: str) -> list[float]:
    return [breakdown[name] for group in scored for _, breakdown, _ in group]


def models_scorer(cfg: RewardConfig, clients) -> RolloutScorer:
    """The reward models of `cfg` alone (no functions), weighed as a run's scorer weighs them."""
    models = [RewardModel(m, client) for m, client in zip(cfg.models, clients, strict=True)]
    return RolloutScorer(models, cfg.error_reward)


async def score_with_models(scorer: RolloutScorer, prompts=PROMPTS, answers=ANSWERS, targets=TARGETS):
    """Each response's (total, breakdown, notes), as one-turn completions of the prompts."""
    groups = [
        [
            Completion(p, [0], [1], [0.0], a, "stop", 0)
            for p, a in zip(group_prompts, group_answers, strict=True)
        ]
        for group_prompts, group_answers in zip(prompts, answers, strict=True)
    ]
    return await scorer.score(groups, targets)


async def pid_of(handle) -> int:
    """The process of the replica that `handle`'s next call goes to (its only one here)."""
    return (await handle.process.route())[1]


def test_a_rollout_is_scored_in_batched_calls_and_the_judges_answers_are_kept(classifier, tiny_policy):
    async def main():
        await init_provisioner(ProvisionerConfig())
        cfg = reward_config(classifier, tiny_policy, batch_size=4)
        rm, judge = await launch_reward_models(cfg, gpus=False)
        models = models_scorer(cfg, [rm, judge])
        try:
            scored = await score_with_models(models)
            served = {
                name: sum(r["served"] for r in client.handle.stats())
                for name, client in (("rm", rm), ("judge", judge))
            }
            return models, scored, served
        finally:
            await shutdown()

    models, scored, served = asyncio.run(main())
    # 8 responses: two calls of batch_size 4 to the classifier, one call to the judge.
    assert served == {"rm": 2, "judge": 1}
    assert flat_values(scored, "rm") == pytest.approx(expected_scores(classifier), abs=1e-5)
    judge_config = models.sources[1].config
    answers = [notes["judge"] for group in scored for _, _, notes in group]
    # Each kept as the judge wrote it. The random judge may write nothing to a question (its
    # greedy first token the end, as the CPU's float sums fall: one CI run's answers had one ''),
    # but not to all of them.
    assert len(answers) == 8 and all(isinstance(a, str) for a in answers) and any(answers)
    parsed = [judge_config.parse.score(a) for a in answers]
    assert flat_values(scored, "judge") == [ERROR_REWARD if p is None else p for p in parsed]
    # The random judge does not answer as asked: each unparsable answer is an error, counted.
    assert models.counts == {"errors": parsed.count(None), "timeouts": 0}


def test_a_replica_that_dies_or_hangs_is_replaced_and_its_call_retried(classifier):
    async def main():
        await init_provisioner(ProvisionerConfig())
        cfg = reward_config(classifier, timeout_s=3.0)
        models = models_scorer(cfg, await launch_reward_models(cfg, gpus=False))
        service = models.sources[0].client.handle
        try:
            os.kill(await pid_of(service), signal.SIGKILL)
            died = await score_with_models(models)
            os.kill(await pid_of(service), signal.SIGSTOP)
            hung = await score_with_models(models)
            return models, service.replacements, died, hung
        finally:
            await shutdown()

    models, replacements, died, hung = asyncio.run(main())
    expected = pytest.approx(expected_scores(classifier), abs=1e-5)
    assert replacements == 2
    assert flat_values(died, "rm") == expected and flat_values(hung, "rm") == expected
    assert models.counts == {"errors": 0, "timeouts": 0}


def test_a_lone_model_that_hangs_scores_error_reward_and_is_counted(classifier):
    async def main():
        await init_provisioner(ProvisionerConfig())
        cfg = reward_config(classifier, timeout_s=2.0)
        m = cfg.models[0]
        actor = await ClassifierRewardModel.as_actor(m.path, m.batch_size)
        models = models_scorer(cfg, [ServiceModel(actor, m.timeout_s)])
        try:
            os.kill(await pid_of(actor), signal.SIGSTOP)
            return models, await score_with_models(models)
        finally:
            await shutdown()

    models, scored = asyncio.run(main())
    assert flat_values(scored, "rm") == [ERROR_REWARD] * 8
    assert models.counts == {"errors": 0, "timeouts": 1}


def test_a_grpo_run_weighs_in_a_classifier_and_a_judge_and_records_the_judges_answers(
    classifier, tiny_policy, write_grpo_config
):
    """Also a run with eval.every=0 and no eval set: none is needed, and none may be scored (an
    empty set's accuracy is NaN): no eval at all, nothing NaN written."""
    models = (
        f"{{name: rm, path: {classifier}, kind: classifier, weight: 0.5}}, "
        f"{{name: judge, path: {tiny_policy}, kind: judge, engine: hf, sampling: {{max_tokens: 4}}}}"
    )
    config = write_grpo_config(reward=f"{{error_reward: -1.0, models: [{models}]}}")
    run_dir = config.parent / "run"
    history = main(
        [
            "--config",
            str(config),
            "max_steps=2",
            "eval.every=0",
            "dataset.toy_task.num_eval=0",
            "trainer.loss.beta=0",
            f"metrics.tensorboard_dir={run_dir / 'tensorboard'}",
        ]
    )
    records = [r for r in read_records(run_dir / "rollouts.jsonl") if not r["eval"]]
    assert records
    for r in records:
        breakdown = r["reward_breakdown"]
        assert set(breakdown) == {"toy_task", "rm", "judge"}
        assert r["reward"] == pytest.approx(
            breakdown["toy_task"] + 0.5 * breakdown["rm"] + breakdown["judge"]
        )
        assert isinstance(r["reward_notes"]["judge"], str)
        assert (
            breakdown["judge"] == JudgeParse().score(r["reward_notes"]["judge"]) or breakdown["judge"] == -1.0
        )
    text = (run_dir / "metrics.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines()]
    keys = set().union(*rows)
    assert {"reward/rm", "reward/judge", "reward/rm/calls", "reward/judge/calls"} <= keys

    # eval.every=0: no eval before step 1, between steps or at the end; nothing NaN.
    assert history["eval_accuracy"] == []
    assert "NaN" not in text and "Infinity" not in text
    assert [row["step"] for row in rows] == [1, 2]
    assert [key for row in rows for key in row if key.startswith("eval/") or row[key] is None] == []
    assert not any(record["eval"] for record in read_records(run_dir / "rollouts.jsonl"))
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss/pg")] == [1, 2]
    assert not [tag for tag in events.Tags()["scalars"] if tag.startswith("eval/")]
    assert children_left(15) == []


def test_a_reward_model_of_the_wrong_kind_is_refused_before_start_up(classifier, tiny_policy):
    cfg = RewardConfig.model_validate(
        {"models": [{"name": "rm", "path": str(tiny_policy), "kind": "classifier"}]}
    )
    with pytest.raises(ValueError, match=r"reward.models\[0\].path: .* needs an architecture ending in "):
        check_reward_models(cfg.models)
    missing = RewardConfig.model_validate({"models": [{"name": "j", "path": "/nowhere", "kind": "judge"}]})
    with pytest.raises(FileNotFoundError, match=r"reward.models\[0\].path: model directory '/nowhere'"):
        check_reward_models(missing.models)
    check_reward_models(reward_config(classifier, tiny_policy).models)


class Answers:
    """An endpoint's `route_within` that returns (or raises) what it is given, in this process."""

    def __init__(self, outcome):
        self.outcome = outcome

    async def route_within(self, seconds, *args, **kwargs):
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


def test_a_non_finite_score_or_a_raising_endpoint_scores_error_reward_and_is_counted(classifier):
    cfg = reward_config(classifier)
    nan_model = type("Model", (), {"score": Answers([0.5, float("nan")])})()
    raising_model = type("Model", (), {"score": Answers(RuntimeError("CUDA out of memory"))})()
    for handle, expected in ((nan_model, [0.5, ERROR_REWARD]), (raising_model, [ERROR_REWARD] * 2)):
        models = models_scorer(cfg, [ServiceModel(handle, cfg.models[0].timeout_s)])
        scored = asyncio.run(score_with_models(models, [["1+1="] * 2], [["2", "3"]], ["2"]))
        assert flat_values(scored, "rm") == expected
        assert models.counts == {"errors": 1, "timeouts": 0}


class Routed:
    """An endpoint's `route` that returns `value`, in this process."""

    def __init__(self, value):
        self.value = value

    async def route(self, *args, **kwargs):
        return self.value


def test_the_starvation_report_counts_the_reward_models_failures(classifier):
    cfg = reward_config(classifier)
    failing = type("Model", (), {"score": Answers(RuntimeError("CUDA out of memory"))})()

    async def failing_functions(prompts, responses, targets):
        # As the reward actor answers: two calls of `f` raised, one of `g` timed out.
        [[first, second]] = responses
        return [
            [
                {
                    "f": Failure("errors", f"f raised on {first}"),
                    "g": Failure("timeouts", f"g hung on {first}"),
                },
                {"f": Failure("errors", f"f raised on {second}"), "g": 0.0},
            ]
        ]

    scorer = RolloutScorer(
        [
            RewardFunctions(failing_functions, {"f": 1.0, "g": 1.0}),
            RewardModel(cfg.models[0], ServiceModel(failing, cfg.models[0].timeout_s)),
        ],
        ERROR_REWARD,
    )
    asyncio.run(score_with_models(scorer, [["1+1="] * 2], [["2", "3"]], ["2"]))
    buffer_counts = {"added": 0, "evicted_stale": 0, "sampled": 0, "held": 0}
    replay_buffer = type("Buffer", (), {"counts": Routed(buffer_counts)})()
    report = asyncio.run(starvation_report(RolloutCounts(), replay_buffer, scorer, ReplayBufferConfig()))
    assert "reward errors 3, reward timeouts 1." in report


def test_the_serial_recipe_weighs_in_a_classifier_and_a_judge_loaded_in_its_process(
    classifier, tiny_policy, write_grpo_config
):
    """The serial recipe scores with the same `RolloutScorer` as the app, its models loaded in
    its own process: each step's mean reward is the functions' plus the models', weighed."""
    models = (
        f"{{name: rm, path: {classifier}, kind: classifier, weight: 0.5}}, "
        f"{{name: judge, path: {tiny_policy}, kind: judge, engine: hf, sampling: {{max_tokens: 4}}}}"
    )
    config = write_grpo_config(reward=f"{{error_reward: -1.0, models: [{models}]}}")
    cfg = load_config(GRPOConfig, config, ["max_steps=2", "eval.every=0", "rollout.threads=1"])
    rows = grpo_serial(cfg)["metrics"]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["reward/rm/calls"] > 0 and row["reward/judge/calls"] > 0
        weighed = row["reward/toy_task"] + 0.5 * row["reward/rm"] + row["reward/judge"]
        assert row["rollout/reward"] == pytest.approx(weighed, abs=1e-5)
        assert row["reward/total"] == pytest.approx(weighed, abs=1e-5)  # every source's total
