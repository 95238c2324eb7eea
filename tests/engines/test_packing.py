"""Packed micro-batches (sequences end to end in one row, attention within each) train exactly
as padded rows do: the same per-sequence logprobs, loss, metrics and gradients."""

import pytest
import torch

from forge.engines.titan.config import TitanEngineConfig
from forge.engines.titan.engine import TitanEngine
from forge.engines.titan.packing import pack, plan_microbatches
from forge.rl.batch import PolicyBatch
from forge.rl.losses import build_loss

VOCAB = 40
WIDTH = 14
# Each row's tokens up to its last loss token. With a budget of 12 tokens: 12 fills a micro-batch
# exactly; 5 then 8 would cross the boundary, so 8 opens the next one, which 4 fills exactly.
LENGTHS = [12, 5, 8, 4, 3]
BUDGET = 12


def test_plan_fills_budgets_in_order_and_never_splits_a_sequence():
    assert plan_microbatches(LENGTHS, BUDGET) == [[0], [1], [2, 3], [4]]
    assert plan_microbatches([20, 3, 0, 2], 10) == [[0], [1, 3]]  # too long: alone; empty: left out
    with pytest.raises(ValueError, match="budget"):
        plan_microbatches(LENGTHS, 0)


def test_pack_restarts_positions_and_finds_its_way_back():
    tokens = torch.arange(1, 13).view(3, 4)
    packed = pack(tokens, tokens + 100, torch.tensor([2, 4, 1]))
    assert packed.tokens.tolist() == [[1, 2, 5, 6, 7, 8, 9]]
    assert packed.target_ids.tolist() == [[101, 102, 105, 106, 107, 108, 109]]
    assert packed.positions.tolist() == [[0, 1, 0, 1, 2, 3, 0]]
    assert packed.attention.cu_seq_q.tolist() == [0, 2, 6, 7] and packed.attention.max_q == 4
    padded = packed.to_padded(packed.tokens[..., None].float())[..., 0]
    assert padded.tolist() == [[1, 2, 0, 0], [5, 6, 7, 8], [9, 0, 0, 0]]
    with pytest.raises(ValueError, match="lengths"):
        pack(tokens, tokens, torch.tensor([0, 4, 1]))


def ragged_policy_batch(seed: int = 0) -> PolicyBatch:
    generator = torch.Generator().manual_seed(seed)
    rows = len(LENGTHS)
    tokens = torch.randint(1, VOCAB, (rows, WIDTH), generator=generator)
    target_ids = torch.randint(1, VOCAB, (rows, WIDTH), generator=generator)
    loss_mask = torch.zeros(rows, WIDTH)
    for row, length in enumerate(LENGTHS):
        loss_mask[row, length // 3 : length] = 1.0  # a prompt, then the response up to the length
        tokens[row, length:] = 0  # padding
        target_ids[row, length:] = -100  # an ignore index, as some collators write
    return PolicyBatch(
        target_ids=target_ids,
        loss_mask=loss_mask,
        tokens=tokens,
        advantages=torch.randn(rows, generator=generator),
        generator_logprobs=-torch.rand(rows, WIDTH, generator=generator) * 4 * loss_mask,
        ref_logprobs=-torch.rand(rows, WIDTH, generator=generator) * 4 * loss_mask,
    )


def engine(packing: bool) -> TitanEngine:
    training = {"seq_len": 32, "packing": packing, "max_norm": 1e9}
    if packing:
        training["microbatch_tokens"] = BUDGET
    return TitanEngine(
        TitanEngineConfig.model_validate({"model": {"vocab_size": VOCAB}, "training": training})
    )


@pytest.mark.parametrize(
    "loss",
    [
        build_loss("grpo", beta=0.1),
        build_loss("gspo", agg_type="sequence_mean", temperature=0.7),
        build_loss("sft", agg_type="sequence_sum"),
        build_loss("grpo", entropy_coef=0.05),
    ],
    ids=["grpo", "gspo-sequence-mean", "sft", "grpo-entropy-bonus"],
)
def test_packed_microbatches_equal_padded_rows(loss):
    batch = ragged_policy_batch()
    packed, padded = engine(packing=True), engine(packing=False)
    mask = batch.loss_mask != 0
    scores = [e.score_tokens(batch.tokens, batch.target_ids, batch.loss_mask, 0.7) for e in (packed, padded)]
    torch.testing.assert_close(scores[0].logprobs[mask], scores[1].logprobs[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(scores[0].entropy[mask], scores[1].entropy[mask], rtol=0, atol=1e-5)
    assert (scores[0].logprobs[~mask] == 0).all()

    metrics = [e.train_step(batch, loss) for e in (packed, padded)]
    for name, value in metrics[1].items():
        if name.startswith(("loss/", "sft/", "train/")) and name not in ("train/grad_norm",):
            assert metrics[0][name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    assert metrics[0]["train/grad_norm"] == pytest.approx(metrics[1]["train/grad_norm"], rel=1e-5)
    padded_grads = dict(padded.model.named_parameters())
    for name, parameter in packed.model.named_parameters():
        want = padded_grads[name].grad
        relative = float((parameter.grad - want).norm() / want.norm())
        assert relative < 1e-5, (name, relative)  # float32 rounding: about 1e-6
    # Packing computed only the sequences' tokens; the padded rows computed every column.
    assert metrics[0]["trainer/padding_frac"] == 0.0
    assert metrics[1]["trainer/padding_frac"] == pytest.approx(1 - sum(LENGTHS) / batch.tokens.numel())
    for m in metrics:
        assert m["trainer/tokens_per_s"] > 0 and m["trainer/forward_s"] > 0 and m["trainer/backward_s"] > 0
        assert "trainer/mfu" not in m  # no known peak on a CPU


def test_a_compiled_model_trains_packed_rows_as_the_eager_one():
    batch = ragged_policy_batch(seed=1)
    loss = build_loss("grpo")
    eager = engine(packing=True)
    compiled = TitanEngine(
        TitanEngineConfig.model_validate(
            {
                "model": {"vocab_size": VOCAB},
                "training": {"seq_len": 32, "microbatch_tokens": BUDGET, "max_norm": 1e9, "compile": True},
            }
        )
    )
    metrics = [e.train_step(batch, loss) for e in (eager, compiled)]
    # The loss is a sum of terms that nearly cancel (advantages of mean zero): its rounding is the
    # terms' (about 1e-9 here, with the CPU's own vector width), not its own small value's.
    assert metrics[1]["train/loss"] == pytest.approx(metrics[0]["train/loss"], rel=1e-5, abs=1e-8)
    assert metrics[1]["train/grad_norm"] == pytest.approx(metrics[0]["train/grad_norm"], rel=1e-4)
