"""Per-token advantages of a rollout's episodes (forge.rollout.token_advantages), in one process:
REINFORCE++ over the rollout and a teacher's term, on a multi-turn episode (the environment's
tokens get none) and responses of different lengths, against plain loops."""

import math

import pytest
import torch

from forge.data.types import Completion, Episode
from forge.observability.collector import pop_state
from forge.rl.batch import PolicyBatch
from forge.rollout.token_advantages import GAE, TokenAdvantages


def episode(logprobs, mask=None, reward=0.0, advantage=0.0, ref=None) -> Episode:
    response = [7 + i for i in range(len(logprobs))]
    completion = Completion("p", [1, 2], response, logprobs, "r", "stop", 0, response_mask=mask)
    return Episode(completion, "t", "g", reward=reward, advantage=advantage, ref_logprobs=ref)


def episodes():
    """A multi-turn trajectory (model, environment, model tokens), a short and a long response."""
    return [
        episode(
            [-0.5, -1.0, 0.0, 0.0, -2.0],
            mask=[1, 1, 0, 0, 1],
            reward=1.0,
            advantage=0.5,
            ref=[-1.0, -0.5, 0.0, 0.0, -1.5],
        ),
        episode([-0.25], reward=0.0, advantage=-1.0, ref=[-0.75]),
        episode([-3.0, -0.125, -1.0], reward=0.5, advantage=0.25, ref=[-2.0, -0.5, -1.25]),
    ]


TEACHER = [[-0.25, -2.0, 0.0, 0.0, -1.0], [-1.5], [-0.5, -0.5, -0.5]]


def test_reinforce_pp_of_a_rollout_is_the_definition_and_trains_on_model_tokens_only():
    eps = episodes()
    TokenAdvantages(reinforce_pp=True, kl_coef=0.2).apply(eps)
    returns = {}
    for i, e in enumerate(eps):
        steps = [t for t, m in enumerate(e.completion.model_mask) if m]
        rewards = [-0.2 * (e.completion.logprobs[t] - e.ref_logprobs[t]) for t in steps]
        rewards[-1] += e.reward
        returns |= {(i, t): sum(rewards[k:]) for k, t in enumerate(steps)}
    mean = sum(returns.values()) / len(returns)
    std = math.sqrt(sum((r - mean) ** 2 for r in returns.values()) / len(returns))
    for i, e in enumerate(eps):
        want = [
            (returns[i, t] - mean) / (std + 1e-6) if (i, t) in returns else 0.0 for t in range(e.response_len)
        ]
        assert e.token_advantages == pytest.approx(want, abs=1e-6)
    assert eps[0].token_advantages[2:4] == [0.0, 0.0]  # the environment's tokens
    batch = PolicyBatch.from_episodes(eps, pad_id=0)
    assert batch.advantages.shape == batch.loss_mask.shape
    assert (batch.advantages[batch.loss_mask == 0] == 0).all()


def test_a_teacher_adds_its_weighted_logprob_gap_to_the_group_advantage_and_records_the_reverse_kl():
    pop_state()
    eps = episodes()
    TokenAdvantages(distill_weight=0.5).apply(eps, TEACHER)
    for e, teacher in zip(eps, TEACHER, strict=True):
        c = e.completion
        want = [
            e.advantage + 0.5 * (t - s) if m else 0.0
            for s, t, m in zip(c.logprobs, teacher, c.model_mask, strict=True)
        ]
        assert e.token_advantages == pytest.approx(want, abs=1e-6)
    per_episode = [
        sum(
            s - t
            for s, t, m in zip(e.completion.logprobs, teacher, e.completion.model_mask, strict=True)
            if m
        )
        / sum(e.completion.model_mask)
        for e, teacher in zip(eps, TEACHER, strict=True)
    ]
    assert pop_state()["distill/reverse_kl"].value() == pytest.approx(sum(per_episode) / 3, abs=1e-6)


def test_reinforce_pp_with_a_teacher_adds_both_and_missing_scores_are_refused():
    plain, taught = episodes(), episodes()
    TokenAdvantages(reinforce_pp=True).apply(plain)
    TokenAdvantages(reinforce_pp=True, distill_weight=2.0).apply(taught, TEACHER)
    for p, t, teacher in zip(plain, taught, TEACHER, strict=True):
        gap = torch.tensor(teacher) - torch.tensor(t.completion.logprobs)
        gap = gap * torch.tensor(t.completion.model_mask)
        torch.testing.assert_close(
            torch.tensor(t.token_advantages), torch.tensor(p.token_advantages) + 2.0 * gap
        )
    with pytest.raises(ValueError, match="distillation needs the teacher's logprobs"):
        TokenAdvantages(distill_weight=1.0).apply(episodes())
    no_ref = episodes()
    no_ref[1].ref_logprobs = None
    with pytest.raises(ValueError, match="KL penalty needs the reference logprobs"):
        TokenAdvantages(reinforce_pp=True, kl_coef=0.1).apply(no_ref)


VALUES = [[0.5, -0.25, 9.0, 9.0, 0.125], [0.75], [0.0, 0.25, -0.5]]


def test_gae_of_a_rollout_discounts_the_token_rewards_over_model_tokens_and_keeps_values_and_returns():
    """GAE over each episode's model tokens (the environment's are skipped: their values, 9.0
    here, are never read), with REINFORCE++'s token rewards (the KL penalty, and the reward on
    the last model token); the advantages normalised over the rollout; the critic's values and
    the returns kept on the episodes, 0 on the environment's tokens."""
    gamma, lam, kl_coef = 0.9, 0.7, 0.2
    eps = episodes()
    TokenAdvantages(gae=GAE(gamma, lam), kl_coef=kl_coef).apply(eps, values=VALUES)
    raw, returns = {}, {}
    for i, e in enumerate(eps):
        steps = [t for t, m in enumerate(e.completion.model_mask) if m]
        rewards = [-kl_coef * (e.completion.logprobs[t] - e.ref_logprobs[t]) for t in steps]
        rewards[-1] += e.reward
        values = [VALUES[i][t] for t in steps]
        advantage = 0.0
        for k in reversed(range(len(steps))):
            following = values[k + 1] if k + 1 < len(steps) else 0.0
            advantage = rewards[k] + gamma * following - values[k] + gamma * lam * advantage
            raw[i, steps[k]] = advantage
            returns[i, steps[k]] = advantage + values[k]
    mean = sum(raw.values()) / len(raw)
    std = math.sqrt(sum((a - mean) ** 2 for a in raw.values()) / len(raw))
    for i, e in enumerate(eps):
        at = range(e.response_len)
        assert e.token_advantages == pytest.approx(
            [(raw[i, t] - mean) / (std + 1e-6) if (i, t) in raw else 0.0 for t in at], abs=1e-5
        )
        assert e.returns == pytest.approx([returns.get((i, t), 0.0) for t in at], abs=1e-6)
        assert e.values == pytest.approx([VALUES[i][t] if (i, t) in raw else 0.0 for t in at])
    assert eps[0].returns[2:4] == [0.0, 0.0] and eps[0].values[2:4] == [0.0, 0.0]
    batch = PolicyBatch.from_episodes(eps, pad_id=0)
    assert batch.values.shape == batch.returns.shape == batch.loss_mask.shape
    assert (batch.returns[batch.loss_mask == 0] == 0).all()
    explained = pop_state()["critic/explained_variance"].value()
    flat_returns = [returns[k] for k in raw]
    flat_values = [returns[k] - raw[k] for k in raw]
    spread = sum((r - sum(flat_returns) / len(raw)) ** 2 for r in flat_returns) / len(raw)
    missed = [r - v for r, v in zip(flat_returns, flat_values, strict=True)]
    missed_spread = sum((m - sum(missed) / len(raw)) ** 2 for m in missed) / len(raw)
    assert explained == pytest.approx(1 - missed_spread / spread, abs=1e-5)


def test_gae_needs_the_critics_values_and_is_not_reinforce_pp():
    with pytest.raises(ValueError, match="GAE needs the critic's values"):
        TokenAdvantages(gae=GAE()).apply(episodes())
    with pytest.raises(ValueError, match="reinforce_pp and gae are two advantages"):
        TokenAdvantages(reinforce_pp=True, gae=GAE())
