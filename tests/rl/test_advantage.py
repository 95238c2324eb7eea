"""forge.rl.advantage against plain float64 references written with Python loops and math."""

import math

import pytest
import torch

from forge.rl.advantage import (
    distill_advantages,
    gae,
    group_advantages,
    has_signal,
    reinforce_pp_advantages,
)


def ref_advantages(group: list[float], mode: str, eps: float) -> list[float]:
    size = len(group)
    mean = sum(group) / size
    if mode == "none":
        return list(group)
    if mode == "dr_grpo":
        return [r - mean for r in group]
    if mode == "grpo":
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / size)
        return [(r - mean) / (std + eps) for r in group]
    assert mode == "rloo"
    if size == 1:
        return [0.0]
    return [r - (sum(group) - r) / (size - 1) for r in group]


GROUPS = torch.tensor(
    [[1.0, 0.0, 0.0, 1.0, 1.0], [0.2, 0.9, -0.4, 0.0, 0.3], [0.5, 0.5, 0.5, 0.5, 0.5]], dtype=torch.float64
)


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo", "none"])
def test_group_advantages_match_reference_for_one_and_many_groups(mode):
    many = group_advantages(GROUPS, mode, eps=1e-4)
    assert many.shape == GROUPS.shape
    for row, group in enumerate(GROUPS.tolist()):
        want = ref_advantages(group, mode, eps=1e-4)
        assert many[row].tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)
        one = group_advantages(GROUPS[row], mode, eps=1e-4)
        assert one.tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
def test_equal_rewards_and_single_completion_groups_give_zero_not_nan(mode):
    assert group_advantages(torch.tensor([[1.0]]), mode).tolist() == [[0.0]]
    assert group_advantages(torch.tensor([3.0]), mode).tolist() == [0.0]
    # float32 0.7 * 7 does not average back to 0.7 exactly: the rounding error must not survive
    assert group_advantages(torch.full((2, 7), 0.7), mode).abs().max().item() == 0.0


def test_grpo_advantages_have_unit_population_variance():
    advantages = group_advantages(GROUPS[:2], "grpo", eps=0.0)
    torch.testing.assert_close(advantages.var(-1, correction=0), torch.ones(2, dtype=torch.float64))


def test_integer_rewards_give_float_advantages():
    advantages = group_advantages(torch.tensor([1, 0, 0, 1]), "dr_grpo")
    assert advantages.dtype == torch.float32 and advantages.tolist() == [0.5, -0.5, -0.5, 0.5]


def test_none_returns_a_copy():
    rewards = torch.tensor([1.0, 2.0])
    advantages = group_advantages(rewards, "none")
    advantages[0] = 5.0
    assert rewards[0].item() == 1.0


def test_group_advantages_rejects_bad_mode_and_shape():
    with pytest.raises(ValueError, match="mode"):
        group_advantages(GROUPS, "ppo")
    with pytest.raises(ValueError, match=r"\[G\] or \[N, G\], got \(2, 3, 4\)"):
        group_advantages(torch.zeros(2, 3, 4))


def test_has_signal():
    assert has_signal(torch.tensor([1.0, 0.0, 1.0])) is True
    assert has_signal(torch.tensor([0.5, 0.5, 0.5])) is False
    assert has_signal(torch.tensor([1.0])) is False
    assert has_signal(GROUPS).tolist() == [True, True, False]
    with pytest.raises(ValueError, match=r"got \(\)"):
        has_signal(torch.tensor(1.0))


def ref_gae(rewards: list[float], values: list[float], mask: list[int], gamma: float, lam: float):
    """One sequence, by the definition: the response tokens in order (masked-out ones are no step),
    delta_k = r_k + gamma * V_{k+1} - V_k with V past the last one 0, and A_k the sum of
    (gamma * lam)^(j - k) * delta_j for j from k."""
    steps = [t for t, m in enumerate(mask) if m]
    r = [rewards[t] for t in steps]
    v = [values[t] for t in steps] + [0.0]
    deltas = [r[k] + gamma * v[k + 1] - v[k] for k in range(len(steps))]
    advantages, returns = [0.0] * len(mask), [0.0] * len(mask)
    for k, t in enumerate(steps):
        advantages[t] = sum((gamma * lam) ** (j - k) * deltas[j] for j in range(k, len(steps)))
        returns[t] = advantages[t] + v[k]
    return advantages, returns


@pytest.mark.parametrize(
    "gamma, lam", [(1.0, 1.0), (0.0, 1.0), (1.0, 0.0), (0.0, 0.0), (0.99, 0.95), (0.9, 1.0)]
)
def test_gae_matches_the_definition_for_random_rewards_values_and_masks(gamma, lam):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(6, 9, generator=g, dtype=torch.float64)
    values = torch.randn(6, 9, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 9, generator=g) > 0.3).long()
    # Sequences of different lengths (right padding), one with no response token, one whole.
    mask[1, 4:] = 0
    mask[2] = 0
    mask[3] = 1
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    assert advantages.dtype == returns.dtype == torch.float64
    for i in range(6):
        want_a, want_r = ref_gae(rewards[i].tolist(), values[i].tolist(), mask[i].tolist(), gamma, lam)
        torch.testing.assert_close(
            advantages[i], torch.tensor(want_a, dtype=torch.float64), rtol=0, atol=1e-12
        )
        torch.testing.assert_close(returns[i], torch.tensor(want_r, dtype=torch.float64), rtol=0, atol=1e-12)


def test_gae_at_lambda_one_is_the_discounted_return_minus_the_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.2, 0.7, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    advantages, returns = gae(rewards, values, mask, gamma=0.5, lam=1.0)
    torch.testing.assert_close(returns, torch.tensor([[0.25, 0.5, 1.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(advantages, returns - torch.where(mask.bool(), values, 0.0))


def test_gae_refuses_shapes_and_factors_out_of_range():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="must be \\[batch, tokens\\] alike"):
        gae(x, torch.zeros(2, 4), x)
    with pytest.raises(ValueError, match="gamma and lam must be in \\[0, 1\\]"):
        gae(x, x, x, gamma=1.5)


def random_token_batch(seed: int = 0):
    """Rewards [6], logprobs and reference logprobs [6, 9] in float64, and a mask with gaps (an
    environment's turn between model turns), rows of different lengths, and a row with none."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(6, generator=g, dtype=torch.float64)
    logprobs = -torch.rand(6, 9, generator=g, dtype=torch.float64) * 3
    ref_logprobs = -torch.rand(6, 9, generator=g, dtype=torch.float64) * 3
    mask = (torch.rand(6, 9, generator=g) > 0.3).long()
    mask[0] = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1, 0])  # two model turns around an env turn
    mask[1, 4:] = 0
    mask[2] = 0
    mask[3] = 1
    return rewards, logprobs, ref_logprobs, mask


def ref_reinforce_pp(rewards, logprobs, ref_logprobs, mask, kl_coef, eps):
    """By the definition, with loops: each sampled token's reward is -kl_coef * (logp - ref), the
    last sampled token's adds the sequence's reward; a token's return sums the rewards of its
    sequence's sampled tokens from it on; the returns of all sampled tokens are normalised by
    their mean and population std."""
    returns = {}
    for i, row in enumerate(mask):
        steps = [t for t, m in enumerate(row) if m]
        token_rewards = [-kl_coef * (logprobs[i][t] - ref_logprobs[i][t]) for t in steps]
        if steps:
            token_rewards[-1] += rewards[i]
        for k, t in enumerate(steps):
            returns[i, t] = sum(token_rewards[k:])
    mean = sum(returns.values()) / len(returns)
    std = math.sqrt(sum((r - mean) ** 2 for r in returns.values()) / len(returns))
    out = [[0.0] * len(mask[0]) for _ in mask]
    for (i, t), r in returns.items():
        out[i][t] = (r - mean) / (std + eps)
    return out


@pytest.mark.parametrize("kl_coef", [0.0, 0.1, 1.0])
def test_reinforce_pp_matches_the_definition_with_gaps_and_different_lengths(kl_coef):
    rewards, logprobs, ref_logprobs, mask = random_token_batch()
    got = reinforce_pp_advantages(rewards, mask, logprobs, ref_logprobs, kl_coef=kl_coef)
    want = ref_reinforce_pp(
        rewards.tolist(), logprobs.tolist(), ref_logprobs.tolist(), mask.tolist(), kl_coef, 1e-6
    )
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
    # Normalised over the batch's sampled tokens: mean 0, population std 1 (up to eps).
    sampled = mask.bool()
    assert abs(got[sampled].mean().item()) < 1e-12
    assert got[sampled].std(correction=0).item() == pytest.approx(1.0, abs=1e-5)
    assert (got[~sampled] == 0).all()


def test_reinforce_pp_without_a_reference_is_the_normalised_reward_on_every_token():
    rewards, _, _, mask = random_token_batch(1)
    got = reinforce_pp_advantages(rewards, mask)
    torch.testing.assert_close(
        got, reinforce_pp_advantages(rewards, mask, torch.zeros(6, 9), torch.ones(6, 9), kl_coef=0.0)
    )
    for i in range(6):  # no penalty: every sampled token of a sequence has the same advantage
        assert len(set(got[i][mask[i].bool()].tolist())) <= 1
    assert reinforce_pp_advantages(torch.ones(2), torch.zeros(2, 3)).eq(0).all()


def test_reinforce_pp_refuses_mismatched_inputs():
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"rewards must be \[batch\] = \[2\], got \(3,\)"):
        reinforce_pp_advantages(torch.ones(3), mask)
    with pytest.raises(ValueError, match=r"mask \(2, 3\) and logprobs \(2, 4\)"):
        reinforce_pp_advantages(torch.ones(2), mask, torch.zeros(2, 4), torch.zeros(2, 4), 0.1)
    with pytest.raises(ValueError, match="needs both logprobs and ref_logprobs"):
        reinforce_pp_advantages(torch.ones(2), mask, torch.zeros(2, 3), None, 0.1)


def test_distill_advantages_are_the_teacher_minus_student_logprob_of_each_sampled_token():
    _, student, teacher, mask = random_token_batch(2)
    got = distill_advantages(student, teacher, mask)
    want = [
        [teacher[i][t].item() - student[i][t].item() if mask[i][t] else 0.0 for t in range(9)]
        for i in range(6)
    ]
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"mask \(6, 9\) and student \(6, 9\), teacher \(6, 8\)"):
        distill_advantages(student, teacher[:, :8], mask)
