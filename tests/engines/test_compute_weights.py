"""Mixed precision without FSDP: the float32 weights are cast to bfloat16 once per train step,
not in every micro-batch, and the step's float32 gradients are those of the bfloat16 passes."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from forge.engines.titan.config import TitanEngineConfig
from forge.engines.titan.engine import TitanEngine
from forge.rl.batch import PolicyBatch
from forge.rl.losses import build_loss

VOCAB = 40
ROWS, WIDTH = 6, 12


def engine(compute_dtype: str) -> TitanEngine:
    training = {
        "seq_len": 32,
        "microbatch_tokens": 2 * WIDTH,  # two sequences a micro-batch: three micro-batches
        "max_norm": 1e9,
        "mixed_precision_param": compute_dtype,
    }
    return TitanEngine(
        TitanEngineConfig.model_validate({"model": {"vocab_size": VOCAB}, "training": training})
    )


def policy_batch() -> PolicyBatch:
    generator = torch.Generator().manual_seed(0)
    loss_mask = torch.zeros(ROWS, WIDTH)
    loss_mask[:, WIDTH // 2 :] = 1.0
    return PolicyBatch(
        target_ids=torch.randint(1, VOCAB, (ROWS, WIDTH), generator=generator),
        loss_mask=loss_mask,
        tokens=torch.randint(1, VOCAB, (ROWS, WIDTH), generator=generator),
        advantages=torch.randn(ROWS, generator=generator),
        generator_logprobs=-torch.rand(ROWS, WIDTH, generator=generator) * loss_mask,
    )


class CastsOfTensors(TorchDispatchMode):
    """Counts the float32 -> bfloat16 copies made of each of the given tensors."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.counts = {t.data_ptr(): 0 for t in tensors}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args else None
        if (
            func is torch.ops.aten._to_copy.default
            and kwargs.get("dtype") == torch.bfloat16
            and source.dtype == torch.float32
            and source.data_ptr() in self.counts
        ):
            self.counts[source.data_ptr()] += 1
        return func(*args, **kwargs)


def test_each_weight_is_cast_once_per_step_and_the_masters_stay_float32():
    mixed = engine("bfloat16")
    masters = list(mixed.model.parameters())
    with CastsOfTensors(masters) as casts:
        metrics = mixed.train_step(policy_batch(), build_loss("grpo"))
    assert metrics["train/step"] == 1
    # Three micro-batches, yet one cast of each weight (autocast would cast at every use).
    assert set(casts.counts.values()) == {1}
    assert list(mixed.model.parameters()) == masters  # the same objects are back in the modules
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in masters)


def test_the_steps_gradients_are_the_bfloat16_passes_summed_in_float32():
    batch, loss = policy_batch(), build_loss("grpo")
    mixed, full = engine("bfloat16"), engine("float32")  # the same seed: the same initial weights
    for e in (mixed, full):
        e.train_step(batch, loss)
    full_grads = dict(full.model.named_parameters())
    for name, parameter in mixed.model.named_parameters():
        want = full_grads[name].grad
        relative = float((parameter.grad - want).norm() / want.norm())
        assert relative < 0.05, (name, relative)  # bfloat16 rounding, about 1e-2
    # And the updated weights are float32 masters that moved, not bfloat16 copies.
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    scores = mixed.score_tokens(batch.tokens, batch.target_ids, batch.loss_mask)
    assert scores.logprobs.dtype == torch.float32 and torch.isfinite(scores.logprobs).all()
