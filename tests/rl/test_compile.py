"""Every loss compiles whole with inductor (fullgraph, so metrics cause no graph break) and matches eager.

Shapes are tiny and static: compile time, not the kernels, is what costs here.
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from forge.rl.batch import PolicyBatch
from forge.rl.losses import LOSSES, GRPOLoss, build_loss
from forge.rl.ops import compute_logprobs

B, T, V = 2, 4, 8
MASK = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]])


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # Each test compiles the same __call__ code object for another loss: start from a clean cache
    # so that no test can hit the recompile limit and silently fall back to eager.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compile_counted(fn):
    counter = CompileCounterWithBackend("inductor")
    return torch.compile(fn, backend=counter, fullgraph=True, dynamic=False), counter


def inputs():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=gen)
    targets = torch.randint(0, V, (B, T), generator=gen)
    with torch.no_grad():
        logprobs = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    generator_logprobs = logprobs + torch.randn(B, T, generator=gen) * 0.3
    ref_logprobs = logprobs + torch.randn(B, T, generator=gen) * 0.3
    batch = PolicyBatch(
        target_ids=targets,
        loss_mask=MASK,
        advantages=torch.tensor([1.0, -0.5]),
        generator_logprobs=generator_logprobs,
        ref_logprobs=ref_logprobs,
    )
    return logits, batch


@pytest.mark.parametrize("name", [*LOSSES, "grpo_kl"])
def test_loss_compiles_and_matches_eager(name):
    loss_fn = GRPOLoss(beta=0.1) if name == "grpo_kl" else build_loss(name)
    logits, batch = inputs()
    compiled, counter = compile_counted(loss_fn)

    results = []
    for fn in (loss_fn, compiled):
        leaf = logits.clone().requires_grad_()
        out = fn(leaf, batch)
        out.loss.backward()
        results.append((out, leaf.grad))
    (eager, eager_grad), (fast, fast_grad) = results

    assert counter.frame_count == 1, "expected one graph for the whole loss"
    torch.testing.assert_close(fast.loss, eager.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast_grad, eager_grad, rtol=1e-5, atol=1e-6)
    assert fast.metrics.keys() == eager.metrics.keys()
    assert fast.metrics == pytest.approx(eager.metrics, rel=1e-5, abs=1e-6)


def test_compiled_bf16_logprobs_match_eager():
    """Under compile, compute_logprobs takes its fused path rather than the chunked autograd
    Function: the two must agree in value and gradient."""
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(B, T, 64, generator=gen) * 4).to(torch.bfloat16)
    targets = torch.randint(0, 64, (B, T), generator=gen)
    upstream = torch.randn(B, T, generator=gen)

    def weighted(x):
        return (compute_logprobs(x, targets, 0.7) * upstream).sum()

    compiled, counter = compile_counted(weighted)
    grads = []
    for fn in (weighted, compiled):
        leaf = logits.clone().requires_grad_()
        value = fn(leaf)
        value.backward()
        grads.append((value, leaf.grad))
    (eager, eager_grad), (fast, fast_grad) = grads
    assert counter.frame_count == 1
    torch.testing.assert_close(fast, eager, rtol=1e-5, atol=1e-5)
    assert fast_grad.dtype == torch.bfloat16
    torch.testing.assert_close(fast_grad.float(), eager_grad.float(), rtol=1e-2, atol=1e-4)
