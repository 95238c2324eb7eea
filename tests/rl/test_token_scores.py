"""Token scores from hidden states (the output projection fused, chunked) equal those from logits."""

import pytest
import torch

from forge.rl import token_scores
from forge.rl.token_scores import TokenScores, head_scores, scores_from_logits


def inputs(seed: int, bias: bool):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 7, 16, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, generator=generator, requires_grad=True)
    bias_ = torch.randn(50, dtype=torch.float64, generator=generator, requires_grad=True) if bias else None
    targets = torch.randint(0, 50, (3, 7), generator=generator)
    with torch.no_grad():  # some targets are the most likely token
        targets[:, :3] = torch.nn.functional.linear(hidden, weight, bias_)[:, :3].argmax(-1)
    return hidden, weight, bias_, targets


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_elements", [50 * 4, 2**25])  # 4 rows a chunk (a ragged last one), or all
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_scores_equal_scores_from_logits_with_gradients(monkeypatch, bias, chunk_elements, temperature):
    monkeypatch.setattr(token_scores, "_DEFAULT_CHUNK_ELEMENTS", chunk_elements)
    hidden, weight, bias_, targets = inputs(seed=int(temperature * 10) + bias, bias=bias)
    fused = TokenScores.unstack(head_scores(hidden, weight, bias_, targets, temperature))
    logits = torch.nn.functional.linear(hidden, weight, bias_)
    reference = scores_from_logits(logits, targets, temperature)
    torch.testing.assert_close(fused.logprobs, reference.logprobs.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused.entropy, reference.entropy.float(), rtol=1e-6, atol=1e-6)
    assert torch.equal(fused.is_argmax, reference.is_argmax)
    assert fused.is_argmax.any() and not fused.is_argmax.all()

    upstream = torch.randn(targets.shape, dtype=torch.float64)
    params = [t for t in (hidden, weight, bias_) if t is not None]
    fused_grads = torch.autograd.grad((fused.logprobs.double() * upstream).sum(), params)
    reference_grads = torch.autograd.grad((reference.logprobs * upstream).sum(), params)
    for got, want in zip(fused_grads, reference_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_elements", [50 * 4, 2**25])
def test_with_entropy_grad_the_entropy_carries_its_gradient_on_both_paths(monkeypatch, bias, chunk_elements):
    """Against autograd through a plain softmax: d/d(params) of sum(u * logprob + w * entropy)."""
    monkeypatch.setattr(token_scores, "_DEFAULT_CHUNK_ELEMENTS", chunk_elements)
    hidden, weight, bias_, targets = inputs(seed=5 + bias, bias=bias)
    temperature = 0.8
    generator = torch.Generator().manual_seed(1)
    u, w = (torch.randn(targets.shape, dtype=torch.float64, generator=generator) for _ in range(2))
    params = [t for t in (hidden, weight, bias_) if t is not None]
    log_probs = torch.log_softmax(torch.nn.functional.linear(hidden, weight, bias_) / temperature, -1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    target_logprobs = log_probs.gather(-1, targets[..., None]).squeeze(-1)
    want = torch.autograd.grad((u * target_logprobs + w * entropy).sum(), params)

    fused = TokenScores.unstack(head_scores(hidden, weight, bias_, targets, temperature, entropy_grad=True))
    logits = torch.nn.functional.linear(hidden, weight, bias_)
    plain = scores_from_logits(logits, targets, temperature, entropy_grad=True)
    for scores, tolerance in ((fused, 1e-5), (plain, 1e-10)):
        got = torch.autograd.grad((u * scores.logprobs.double() + w * scores.entropy.double()).sum(), params)
        for g, expected in zip(got, want, strict=True):
            torch.testing.assert_close(g, expected, rtol=tolerance, atol=tolerance)
    # Without it the entropy is a number with no graph (no softmax kept for a backward).
    assert not scores_from_logits(logits, targets, temperature).entropy.requires_grad


def test_head_scores_multiply_in_the_autocast_dtype():
    hidden, weight, _, targets = (t.detach().float() if t is not None else None for t in inputs(0, False))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = TokenScores.unstack(head_scores(hidden, weight, None, targets))
        reference = scores_from_logits(torch.nn.functional.linear(hidden, weight), targets)
    assert fused.logprobs.dtype == torch.float32
    torch.testing.assert_close(fused.logprobs, reference.logprobs, rtol=1e-5, atol=1e-5)


def test_head_scores_reject_bad_shapes_and_temperature():
    hidden, weight, _, targets = inputs(0, False)
    with pytest.raises(ValueError, match="hidden must be"):
        head_scores(hidden, weight, None, targets[:, :-1])
    with pytest.raises(ValueError, match="temperature"):
        head_scores(hidden, weight, None, targets, 0.0)
