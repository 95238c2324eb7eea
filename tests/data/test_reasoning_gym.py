"""reasoning-gym tasks as a prompt source and a reward, with the real generators and checkers:
rows come from the tasks, each task scores its own answers, and a cursor resumes exactly on rows
rebuilt in another process."""

import json
import os
import subprocess
import sys

import pytest
import reasoning_gym

from forge.data.prompts import PromptCursor, PromptDataConfig, load_prompt_rows
from forge.data.reasoning_gym_source import decode_target, encode_target
from forge.rewards.functions import get_reward_fn

TASKS = [
    {"name": "chain_sum", "weight": 2, "config": {"min_terms": 2, "max_terms": 3}},
    {"name": "spell_backward"},
    {"name": "leg_counting", "config": {"max_animals": 3}},
    {"name": "basic_arithmetic"},
]


def data_config(**reasoning_gym_settings) -> PromptDataConfig:
    settings = {"tasks": TASKS, "size": 120, "eval_size": 30, "seed": 5, **reasoning_gym_settings}
    return PromptDataConfig.model_validate({"source": "reasoning_gym", "reasoning_gym": settings, "seed": 3})


@pytest.fixture(scope="module")
def rows():
    return load_prompt_rows(data_config())


def item(target: str) -> dict:
    """The reasoning-gym item a row's target names, made here by reasoning-gym itself."""
    fields = decode_target(target)
    return reasoning_gym.create_dataset(fields["task"], **fields["config"])[fields["index"]]


def test_rows_come_from_every_task_and_each_task_scores_its_answers(rows):
    train, evaluation = rows
    assert len(train) == 120 and 0 < len(evaluation) <= 30
    reward = get_reward_fn("reasoning_gym")
    by_task = {}
    for row in train + evaluation:
        by_task.setdefault(decode_target(row["target"])["task"], []).append(row)
    assert sorted(by_task) == sorted(t["name"] for t in TASKS)
    # chain_sum has twice the weight of each other task.
    assert len(by_task["chain_sum"]) > max(len(by_task[t]) for t in by_task if t != "chain_sum")
    for task, task_rows in by_task.items():
        for row in task_rows:
            entry = item(row["target"])
            system, user = row["prompt"]  # the "default" system prompt, then the question
            assert system["role"] == "system" and "<answer>" in system["content"]
            assert user == {"role": "user", "content": entry["question"]}
            assert decode_target(row["target"])["answer"] == entry["answer"]
        row = task_rows[0]
        answer = decode_target(row["target"])["answer"]
        assert reward("p", f"<think>easy</think>\n<answer>{answer}</answer>", row["target"]) == 1.0, task
        assert reward("p", "<answer>#</answer>", row["target"]) == 0.0, task  # in no task's answers
        assert reward("p", answer, row["target"]) == 0.0, task  # no <answer> tags: no answer


def test_eval_rows_are_held_out(rows):
    train, evaluation = rows
    train_questions = {item(r["target"])["question"] for r in train}
    assert not train_questions & {item(r["target"])["question"] for r in evaluation}
    assert {decode_target(r["target"])["index"] for r in evaluation} <= set(range(120, 150))


def test_partial_credit_is_the_tasks_own():
    # spell_backward credits each letter in its place.
    target = load_prompt_rows(data_config(tasks=[{"name": "spell_backward"}], size=1, eval_size=0))[0][0][
        "target"
    ]
    answer = decode_target(target)["answer"]
    expected = reasoning_gym.create_dataset("spell_backward", **decode_target(target)["config"]).score_answer(
        f"{answer}!!", item(target)
    )
    assert 0.0 < expected < 1.0
    assert get_reward_fn("reasoning_gym")("p", f"<answer>{answer}!!</answer>", target) == expected


def test_cursor_resumes_exactly_on_rows_rebuilt_in_another_process(rows):
    train, _ = rows
    cursor = PromptCursor(train, seed=3)
    for _ in range(150):  # past the end of the first epoch
        cursor.next()
    state = cursor.state_dict()
    assert all(type(v) is int for v in state.values())  # loads with torch's weights_only=True
    expected = [cursor.next() for _ in range(20)]

    # A resumed run builds its rows again in a new process, whose string hash seed differs.
    code = (
        "import json, sys\n"
        "from forge.data.prompts import PromptCursor, PromptDataConfig, load_prompt_rows\n"
        "cfg = PromptDataConfig.model_validate(json.loads(sys.argv[1]))\n"
        "cursor = PromptCursor(load_prompt_rows(cfg)[0], cfg.seed)\n"
        "cursor.load_state_dict(json.loads(sys.argv[2]))\n"
        "print(json.dumps([cursor.next() for _ in range(20)]))\n"
    )
    cfg = data_config().model_dump()
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(cfg), json.dumps(state)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "1234"},
    ).stdout
    assert json.loads(out) == expected


def test_system_prompt_settings():
    def first_prompt(system_prompt):
        return load_prompt_rows(data_config(size=1, eval_size=0, system_prompt=system_prompt))[0][0]["prompt"]

    question = item(load_prompt_rows(data_config(size=1, eval_size=0))[0][0]["target"])["question"]
    assert first_prompt("") == question
    assert first_prompt("Answer in <answer> tags.")[0] == {
        "role": "system",
        "content": "Answer in <answer> tags.",
    }
    from reasoning_gym.utils import SYSTEM_PROMPTS

    assert first_prompt("direct")[0]["content"] == SYSTEM_PROMPTS["direct"]


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        (
            {"tasks": [{"name": "chain_sums"}]},
            r"tasks\[0\]\.name: unknown reasoning-gym task 'chain_sums'; the tasks are: .*chain_sum, ",
        ),
        (
            {"tasks": [{"name": "chain_sum"}, {"name": "leg_counting", "config": {"max_legs": 3}}]},
            r"tasks\[1\]\.config: task 'leg_counting' has no setting \['max_legs'\].*: max_animals, ",
        ),
        (
            {"tasks": [{"name": "chain_sum", "config": {"seed": 3}}]},
            r"has no setting \['seed'\] \(seed and size come from",
        ),
        (
            {"tasks": [{"name": "chain_sum", "config": {"min_terms": 0}}]},
            r"tasks\[0\]\.config: task 'chain_sum' refuses \{'min_terms': 0\}",
        ),
    ],
)
def test_bad_tasks_are_named_before_start(settings, error):
    with pytest.raises(ValueError, match=error):
        load_prompt_rows(data_config(**settings))


def test_a_task_whose_rows_follow_the_hash_seed_needs_a_fixed_one(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ValueError, match=r"'word_ladder' builds other rows.*export PYTHONHASHSEED=0"):
        load_prompt_rows(data_config(tasks=[{"name": "word_ladder"}], size=2, eval_size=0))
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert len(load_prompt_rows(data_config(tasks=[{"name": "word_ladder"}], size=2, eval_size=0))[0]) == 2


def test_the_section_is_required_for_the_source():
    cfg = PromptDataConfig.model_validate({"source": "reasoning_gym"})
    with pytest.raises(
        ValueError, match=r"dataset.reasoning_gym is required.*\{tasks: \[\{name: chain_sum\}\]\}"
    ):
        load_prompt_rows(cfg)


def test_reward_refuses_targets_it_cannot_rebuild(rows):
    reward = get_reward_fn("reasoning_gym")
    with pytest.raises(ValueError, match="scores rows of dataset.source=reasoning_gym only"):
        reward("p", "<answer>4</answer>", "4")
    fields = decode_target(rows[0][0]["target"])
    tampered = encode_target(fields["task"], fields["config"], fields["index"], "not the answer")
    with pytest.raises(ValueError, match="same reasoning-gym version"):
        reward("p", "<answer>4</answer>", tampered)
