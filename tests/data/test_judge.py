"""A judge's question template and the rule that reads its answer."""

import pytest
from pydantic import ValidationError

from forge.actors.reward import RewardConfig
from forge.rewards.judge import DEFAULT_TEMPLATE, JudgeParse, check_template, judge_question


def test_the_default_rule_reads_the_last_rating_out_of_ten():
    rule = JudgeParse()
    assert rule.score("Correct and complete. 10/10") == 1.0
    assert rule.score("First 2/10 seemed right,\nbut on reflection: 7 / 10.") == 0.7
    assert rule.score("0/10") == 0.0
    for unparsable in ("I would say seven.", "11/10", "", "score: 5"):
        assert rule.score(unparsable) is None, unparsable


def test_a_custom_rule_and_template():
    rule = JudgeParse(regex=r"Score: (-?\d+(?:\.\d+)?)", scale=100)
    assert rule.score("Score: 85") == 0.85
    assert rule.score("Score: nan") is None
    template = check_template("Q: {prompt} A: {response} ({target}) {{json}}")
    assert judge_question(template, "1+1", "2", "2") == "Q: 1+1 A: 2 (2) {json}"
    assert "{target}" in DEFAULT_TEMPLATE and check_template(DEFAULT_TEMPLATE)


@pytest.mark.parametrize(
    "model, message",
    [
        ({"template": "Rate {answer}"}, r"unknown field\(s\) \['answer'\]: use only \{prompt\}"),
        ({"template": "Rate {response"}, r"literal braces"),
        ({"parse": {"regex": r"\d+/10"}}, r"has no group: put the number in parentheses"),
        ({"parse": {"regex": r"(\d"}}, r"is not a regular expression"),
        ({"sampling": {"n": 4}}, r"a judge answers once"),
        ({"kind": "classifier", "template": "{prompt}"}, r"\['template'\] are settings of a judge"),
        ({"name": "toy_task"}, r"the name 'toy_task' is taken by a reward function"),
    ],
)
def test_bad_reward_model_settings_are_refused_when_the_config_loads(model, message):
    with pytest.raises(ValidationError, match=message):
        RewardConfig.model_validate({"models": [{"name": "judge", "path": "m", "kind": "judge", **model}]})


def test_two_models_may_not_share_a_name():
    model = {"name": "rm", "path": "m", "kind": "classifier"}
    with pytest.raises(ValidationError, match="the name 'rm' is taken by another reward model"):
        RewardConfig.model_validate({"models": [model, model]})
