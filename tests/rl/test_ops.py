"""forge.rl.ops against plain float64 references written with Python loops and math."""

import math

import pytest
import torch
from reference_math import ref_aggregate, ref_entropy, ref_kl, ref_logprob, ref_softmax

from forge.rl import ops
from forge.rl.ops import (
    aggregate,
    compute_entropy,
    compute_kl,
    compute_logprobs,
    compute_ratio,
    ppo_clip_loss,
)

# --- inputs (the float64 references live in tests/support/reference_math.py) ---------------


MASK = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [1, 1, 0, 0, 0]])


def random_logits(shape, dtype=torch.float64, seed=0, scale=2.0):
    return (
        torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        .mul(scale)
        .to(dtype)
    )


# --- compute_logprobs ---------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compute_logprobs_matches_reference(temperature, dtype):
    logits = random_logits((2, 3, 5), dtype)
    targets = torch.tensor([[0, 4, 2], [1, 1, 3]])
    got = compute_logprobs(logits, targets, temperature)
    assert got.dtype == dtype and got.shape == (2, 3)
    rows = logits.double().tolist()
    for b in range(2):
        for t in range(3):
            want = ref_logprob(rows[b][t], int(targets[b, t]), temperature)
            # logp = x_t / T - logsumexp(x / T): float32 error is absolute, about eps * |logsumexp|
            assert got[b, t].item() == pytest.approx(want, abs=1e-6 if dtype == torch.float32 else 1e-13)


@pytest.mark.parametrize("chunk_elements", [7, 2**25])  # 7 elements: one row per chunk
def test_compute_logprobs_gradient_matches_reference(monkeypatch, chunk_elements):
    monkeypatch.setattr(ops, "_CHUNK_ELEMENTS", chunk_elements)
    logits = random_logits((2, 3, 4)).requires_grad_()
    targets = torch.tensor([[0, 3, 2], [1, 1, 0]])
    upstream = torch.tensor([[0.5, -1.0, 2.0], [0.0, 1.5, -0.25]], dtype=torch.float64)
    temperature = 0.8
    (compute_logprobs(logits, targets, temperature) * upstream).sum().backward()
    rows = logits.detach().tolist()
    for b in range(2):
        for t in range(3):
            probs = ref_softmax(rows[b][t], temperature)
            for v in range(4):
                onehot = 1.0 if v == targets[b, t].item() else 0.0
                want = upstream[b, t].item() * (onehot - probs[v]) / temperature
                assert logits.grad[b, t, v].item() == pytest.approx(want, abs=1e-12)


def test_compute_logprobs_gradcheck_across_chunks(monkeypatch):
    monkeypatch.setattr(ops, "_CHUNK_ELEMENTS", 10)  # two rows of 5 per chunk, and a last row alone
    logits = random_logits((1, 5, 5)).requires_grad_()
    targets = torch.tensor([[4, 0, 2, 2, 1]])
    assert torch.autograd.gradcheck(lambda x: compute_logprobs(x, targets, 1.3), (logits,))


def test_compute_logprobs_bf16_matches_float32(monkeypatch):
    monkeypatch.setattr(ops, "_CHUNK_ELEMENTS", 3 * 64)  # several chunks, the last one short
    logits = random_logits((2, 5, 64), torch.bfloat16, scale=4.0).requires_grad_()
    targets = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    upstream = torch.randn(2, 5, generator=torch.Generator().manual_seed(2))
    got = compute_logprobs(logits, targets, 0.9)
    (got * upstream).sum().backward()

    # The same (bf16-representable) values in float32: any difference is the bf16 path's arithmetic.
    exact = logits.detach().float().requires_grad_()
    want = compute_logprobs(exact, targets, 0.9)
    (want * upstream).sum().backward()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert logits.grad.dtype == torch.bfloat16
    # The gradient is rounded once to bf16 (8 bits of mantissa).
    torch.testing.assert_close(logits.grad.float(), exact.grad, rtol=8e-3, atol=1e-5)


def test_compute_logprobs_bf16_saves_no_float32_copy_for_backward():
    logits = random_logits((2, 5, 64), torch.bfloat16).requires_grad_()
    targets = torch.zeros(2, 5, dtype=torch.long)
    saved = []

    def pack(tensor):
        saved.append((tensor.dtype, tensor.numel()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        compute_logprobs(logits, targets).sum().backward()
    assert saved, "expected the logits to be saved for the backward"
    assert (torch.float32, logits.numel()) not in saved


def test_compute_logprobs_rejects_bad_shapes_and_temperature():
    with pytest.raises(ValueError, match=r"logits \(2, 3, 5\), target_ids \(2, 4\)"):
        compute_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"logits \(2, 3\), target_ids \(2, 3\)"):
        compute_logprobs(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        compute_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), temperature=0.0)


# --- compute_entropy ----------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_elements", [6, 2**25])
def test_compute_entropy_matches_reference(monkeypatch, chunk_elements):
    monkeypatch.setattr(ops, "_CHUNK_ELEMENTS", chunk_elements)
    logits = random_logits((3, 5, 6))
    entropy, mean = compute_entropy(logits, MASK, temperature=1.5)
    rows = logits.tolist()
    want = [[ref_entropy(rows[b][t], 1.5) for t in range(5)] for b in range(3)]
    torch.testing.assert_close(entropy, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert mean.item() == pytest.approx(ref_aggregate(want, MASK.tolist(), "token_mean"), rel=1e-12)


def test_compute_entropy_ignores_masked_rows_and_empty_masks():
    logits = random_logits((3, 5, 6))
    garbage = logits.clone()
    garbage[MASK == 0] = 1e4 * random_logits((int((MASK == 0).sum()), 6), seed=3)
    assert compute_entropy(garbage, MASK)[1].item() == pytest.approx(
        compute_entropy(logits, MASK)[1].item(), rel=1e-12
    )
    assert compute_entropy(logits, torch.zeros_like(MASK))[1].item() == 0.0
    with pytest.raises(ValueError, match=r"logits \(3, 5, 6\), loss_mask \(3, 4\)"):
        compute_entropy(logits, MASK[:, :4])


# --- compute_ratio ------------------------------------------------------------------------------


def ratio_inputs():
    logprobs = -torch.rand(3, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 3
    old = logprobs + torch.randn(3, 5, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 0.3
    return logprobs, old


def test_compute_ratio_token_matches_reference():
    logprobs, old = ratio_inputs()
    ratio, log_ratio = compute_ratio(logprobs, old, MASK, "token")
    for b in range(3):
        for t in range(5):
            want = logprobs[b, t].item() - old[b, t].item() if MASK[b, t] else 0.0
            assert log_ratio[b, t].item() == pytest.approx(want, abs=1e-15)
            assert ratio[b, t].item() == pytest.approx(math.exp(want), rel=1e-14)


def test_compute_ratio_sequence_is_exp_of_the_mean_log_ratio_and_its_gradient():
    logprobs, old = ratio_inputs()
    logprobs.requires_grad_()
    ratio, log_ratio = compute_ratio(logprobs, old, MASK, "sequence")
    expected = []
    for b in range(3):
        diffs = [logprobs[b, t].item() - old[b, t].item() for t in range(5) if MASK[b, t]]
        expected.append(math.exp(sum(diffs) / len(diffs)))
        for t in range(5):
            assert ratio[b, t].item() == pytest.approx(expected[b], rel=1e-14)
            assert log_ratio[b, t].item() == pytest.approx(math.log(expected[b]), rel=1e-13)
    # d s_b / d logp_bt = s_b / |y_b| on the sequence's response tokens, 0 elsewhere
    ratio[:, 0].sum().backward()
    for b in range(3):
        tokens = int(MASK[b].sum())
        for t in range(5):
            want = expected[b] / tokens if MASK[b, t] else 0.0
            assert logprobs.grad[b, t].item() == pytest.approx(want, rel=1e-13)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_compute_ratio_ignores_garbage_on_masked_positions(level):
    logprobs, old = ratio_inputs()
    logprobs.requires_grad_()
    garbage = old.clone()
    garbage[0, 0], garbage[0, 4], garbage[1, 0] = -math.inf, math.nan, math.inf
    ratio, _ = compute_ratio(logprobs, garbage, MASK, level)
    clean_ratio, _ = compute_ratio(logprobs, old, MASK, level)
    assert torch.isfinite(ratio).all()
    torch.testing.assert_close(ratio[MASK == 1], clean_ratio[MASK == 1])
    ratio.sum().backward()
    assert torch.isfinite(logprobs.grad).all()


def test_compute_ratio_rejects_bad_shapes_and_level():
    logprobs, old = ratio_inputs()
    with pytest.raises(ValueError, match=r"logprobs \(3, 5\), old_logprobs \(3, 4\), loss_mask \(3, 5\)"):
        compute_ratio(logprobs, old[:, :4], MASK)
    with pytest.raises(ValueError, match="level"):
        compute_ratio(logprobs, old, MASK, "sentence")


# --- compute_kl ---------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl"])
def test_compute_kl_matches_reference(estimator):
    logprobs = torch.tensor([[-1.0, -2.0, -0.1], [-5.0, -0.5, -3.0]], dtype=torch.float64)
    # log-ratios of 0, +-0.3, -2 and +3 (where k3 = e^3 - 4 > 10, so low_var_kl clamps)
    ref = logprobs + torch.tensor([[0.0, 0.3, -0.3], [3.0, -2.0, 1e-9]], dtype=torch.float64)
    got = compute_kl(logprobs, ref, estimator)
    for b in range(2):
        for t in range(3):
            want = ref_kl(logprobs[b, t].item(), ref[b, t].item(), estimator)
            assert got[b, t].item() == pytest.approx(want, rel=1e-9, abs=1e-15)
    if estimator == "low_var_kl":
        assert got[1, 0].item() == 10.0


def test_compute_kl_zero_on_masked_positions_even_for_garbage():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, math.nan]])
    kl = compute_kl(logprobs, ref, "k3", loss_mask=torch.tensor([[1, 0]]))
    assert kl[0, 0].item() == pytest.approx(math.exp(-0.5) + 0.5 - 1, rel=1e-6)
    assert kl[0, 1].item() == 0.0
    kl.sum().backward()
    assert torch.isfinite(logprobs.grad).all()
    with pytest.raises(ValueError, match=r"logprobs \(1, 2\), ref_logprobs \(2, 1\)"):
        compute_kl(logprobs, ref.T)
    with pytest.raises(ValueError, match="estimator"):
        compute_kl(logprobs, ref, "k4")


# --- ppo_clip_loss: the clip boundaries -----------------------------------------------------------


def ref_ppo(ratio: float, advantage: float, clip_low: float, clip_high: float) -> tuple[float, float]:
    """(loss, d loss / d ratio) of -min(r A, clip(r) A); at the boundary the gradient is kept."""
    clipped = min(max(ratio, 1 - clip_low), 1 + clip_high)
    loss = -min(ratio * advantage, clipped * advantage)
    clip_active = (advantage > 0 and ratio > 1 + clip_high) or (advantage < 0 and ratio < 1 - clip_low)
    return loss, 0.0 if clip_active else -advantage


@pytest.mark.parametrize("advantage", [1.5, -1.5])
def test_ppo_clip_loss_at_and_around_the_boundaries(advantage):
    clip_low, clip_high = 0.2, 0.28
    points = []
    for edge in (1 - clip_low, 1 + clip_high):
        points += [math.nextafter(edge, 0), edge, math.nextafter(edge, 2)]
    points += [0.5, 1.0, 2.0]
    ratio = torch.tensor(points, dtype=torch.float64, requires_grad=True)
    advantages = torch.full_like(ratio, advantage)
    loss, clipped_low, clipped_high = ppo_clip_loss(ratio, advantages, clip_low, clip_high)
    loss.sum().backward()
    for i, r in enumerate(points):
        want_loss, want_grad = ref_ppo(r, advantage, clip_low, clip_high)
        assert loss[i].item() == pytest.approx(want_loss, rel=1e-15)
        assert ratio.grad[i].item() == want_grad, f"ratio {r!r}"
        assert bool(clipped_low[i]) == (advantage < 0 and r < 1 - clip_low)
        assert bool(clipped_high[i]) == (advantage > 0 and r > 1 + clip_high)
    # exactly at the edge the gradient is kept; one ulp beyond, on the clipped side, it is gone
    edge = 1 + clip_high if advantage > 0 else 1 - clip_low
    beyond = math.nextafter(edge, 2 if advantage > 0 else 0)
    assert ratio.grad[points.index(edge)].item() == -advantage
    assert ratio.grad[points.index(beyond)].item() == 0.0


# --- aggregate ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "horizon"),
    [
        ("token_mean", None),
        ("sequence_mean", None),
        ("sequence_sum", None),
        ("fixed_horizon", None),
        ("fixed_horizon", 8),
    ],
)
@pytest.mark.parametrize("step", [None, (40, 11)], ids=["batch", "step"])
def test_aggregate_matches_reference(mode, horizon, step):
    """With the counts of a whole step (40 tokens, 11 sequences), a batch gives its share."""
    values = torch.randn(3, 5, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    counts = (
        {}
        if step is None
        else {"step_tokens": torch.tensor(step[0]), "step_sequences": torch.tensor(step[1])}
    )
    got = aggregate(values, MASK, mode, horizon, **counts)
    assert got.item() == pytest.approx(
        ref_aggregate(values.tolist(), MASK.tolist(), mode, horizon, step), rel=1e-14
    )


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean", "sequence_sum", "fixed_horizon"])
def test_aggregate_empty_masks_and_masked_garbage(mode):
    values = torch.randn(3, 5, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    one_empty = MASK.clone()
    one_empty[1] = 0  # a sequence without response tokens is left out, not counted as 0
    want = ref_aggregate(values.tolist(), one_empty.tolist(), mode)
    garbage = values.clone().requires_grad_()
    with torch.no_grad():
        garbage[one_empty == 0] = torch.tensor([math.nan, math.inf] * 5, dtype=torch.float64)
    got = aggregate(garbage, one_empty, mode)
    assert got.item() == pytest.approx(want, rel=1e-14)
    got.backward()
    assert torch.isfinite(garbage.grad).all() and (garbage.grad[one_empty == 0] == 0).all()

    empty = aggregate(values.requires_grad_(), torch.zeros_like(MASK), mode)
    empty.backward()
    assert empty.item() == 0.0 and torch.isfinite(values.grad).all()


def test_aggregate_rejects_bad_input():
    values = torch.zeros(3, 5)
    with pytest.raises(ValueError, match=r"values \(3, 5\), loss_mask \(3, 4\)"):
        aggregate(values, MASK[:, :4], "token_mean")
    with pytest.raises(ValueError, match="mode"):
        aggregate(values, MASK, "mean")
    with pytest.raises(ValueError, match="horizon"):
        aggregate(values, MASK, "fixed_horizon", horizon=0)


def test_broadcast_advantages_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"\[B, T\] = \(3, 5\), got \(4,\)"):
        ops.broadcast_advantages(torch.zeros(4), torch.Size([3, 5]))
    with pytest.raises(ValueError, match=r"got \(3, 4\)"):
        ops.broadcast_advantages(torch.zeros(3, 4), torch.Size([3, 5]))
