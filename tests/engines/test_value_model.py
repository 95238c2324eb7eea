"""The value model (PPO's critic, forge.engines.titan.value): built from a policy checkpoint's
transformer with a zero head, per-token values of completions, a train step that lowers the
clipped value loss, its checkpoints; and the clipped value loss against a float64 loop."""

import random

import pytest
import torch

from forge.data.types import Completion
from forge.engines.titan.config import TitanEngineConfig
from forge.engines.titan.engine import TitanEngine
from forge.engines.titan.value import ValueEngine, completion_values, share_values
from forge.rl.batch import PolicyBatch, pad_sequences, place_responses
from forge.rl.losses.value import ValueLoss, clipped_value_loss

VOCAB = 40


def engine_config(hf_path=None, seed: int = 0, lr: float = 1e-2) -> TitanEngineConfig:
    model = {"hf_path": str(hf_path)} if hf_path is not None else {"vocab_size": VOCAB}
    return TitanEngineConfig.model_validate(
        {"model": model, "training": {"seq_len": 32, "seed": seed}, "optimizer": {"lr": lr}}
    )


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    policy = TitanEngine(engine_config(seed=3), trainable=False)
    return policy.export_hf(tmp_path_factory.mktemp("policy") / "hf")


def completions(count: int = 5) -> list[Completion]:
    rng = random.Random(0)
    out = []
    for i in range(count):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 6))]
        response = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 7))]
        out.append(Completion(f"p{i}", prompt, response, [0.0] * len(response), "", "stop", 0))
    return out


def value_batch(items: list[Completion], old: list[list[float]], returns: list[list[float]]) -> PolicyBatch:
    tokens, target_ids, span = pad_sequences(
        [c.prompt_ids for c in items], [c.response_ids for c in items], 0
    )
    return PolicyBatch(
        target_ids=target_ids,
        loss_mask=span,
        tokens=tokens,
        values=place_responses(old, span),
        returns=place_responses(returns, span),
    )


def test_the_value_model_is_the_policys_transformer_with_a_zero_head(policy_dir):
    critic = ValueEngine(engine_config(policy_dir))
    policy = TitanEngine(engine_config(policy_dir), trainable=False)
    critic_weights, policy_weights = critic._titan_state_dict(), policy._titan_state_dict()
    shared = [name for name in policy_weights if not name.startswith("output.")]
    assert len(shared) > 5
    for name in shared:
        assert torch.equal(critic_weights[name], policy_weights[name]), name
    assert critic_weights["output.weight"].shape == (1, policy_weights["output.weight"].shape[1])
    assert not critic_weights["output.weight"].any() and not critic_weights["output.bias"].any()
    # One value per response token, 0 from the zero head.
    items = completions()
    values = completion_values(critic, items)
    assert [len(v) for v in values] == [len(c.response_ids) for c in items]
    assert all(v == 0.0 for row in values for v in row)
    share = share_values(critic, items)
    assert (share.rank, share.ranks, share.values) == (0, 1, values)


def test_a_train_step_lowers_the_value_loss_on_a_fixed_batch(policy_dir):
    critic = ValueEngine(engine_config(policy_dir, lr=2e-3))
    items = completions()
    rng = random.Random(1)
    returns = [[rng.uniform(0, 1) for _ in c.response_ids] for c in items]
    old = completion_values(critic, items)
    batch = value_batch(items, old, returns)
    loss_fn = ValueLoss(clip=None)
    losses = [critic.train_step(batch, loss_fn)["critic/value_loss"] for _ in range(8)]
    assert losses[-1] < 0.5 * losses[0], losses
    # The values now move towards the returns, at every position of every completion.
    values = completion_values(critic, items)
    assert any(v != 0.0 for row in values for v in row)
    assert critic.step == 8


def test_value_clipping_holds_the_values_near_the_old_ones(policy_dir):
    """With a tiny clip, a value that has left its old one by more than it gets no gradient from
    the clipped term: the loss stays that of the clipped values (their bound), and the clip
    fraction says so."""
    critic = ValueEngine(engine_config(policy_dir, lr=5e-2))
    items = completions()
    returns = [[3.0 for _ in c.response_ids] for c in items]
    batch = value_batch(items, completion_values(critic, items), returns)
    first = critic.train_step(batch, ValueLoss(clip=1e-3))
    second = critic.train_step(batch, ValueLoss(clip=1e-3))
    assert first["critic/clip_frac"] == 0.0  # the values are the old ones at the first step
    assert second["critic/clip_frac"] > 0.5
    # Both the values and their clipped copies stay below the returns: the clipped term, at
    # most 1e-3 from 0, bounds the loss near 0.5 * 3^2.
    assert second["critic/value_loss"] >= 0.5 * (3.0 - 1e-3) ** 2 - 1e-4


def test_the_value_models_checkpoint_resumes_its_training(policy_dir, tmp_path):
    items = completions()
    returns = [[0.5 for _ in c.response_ids] for c in items]
    first = ValueEngine(engine_config(policy_dir))
    batch = value_batch(items, completion_values(first, items), returns)
    first.train_step(batch, ValueLoss(0.2))
    first.save_to(tmp_path / "critic")
    expected = [first.train_step(batch, ValueLoss(0.2))["critic/value_loss"] for _ in range(2)]
    resumed = ValueEngine(engine_config(policy_dir, seed=9))
    resumed.load_from(tmp_path / "critic")
    assert resumed.step == 1
    assert [resumed.train_step(batch, ValueLoss(0.2))["critic/value_loss"] for _ in range(2)] == expected


def test_a_value_model_refuses_lora():
    config = TitanEngineConfig.model_validate({**engine_config().model_dump(), "lora": {"rank": 2}})
    with pytest.raises(ValueError, match="without lora"):
        ValueEngine(config)


@pytest.mark.parametrize("clip", [None, 0.0, 0.05, 0.2, 10.0])
def test_clipped_value_loss_against_a_float64_loop(clip):
    generator = torch.Generator().manual_seed(int((clip or 0) * 100) + 1)
    values, old, returns = (torch.randn(4, 9, dtype=torch.float64, generator=generator) for _ in range(3))
    loss, clipped = clipped_value_loss(values, old, returns, clip)
    for b in range(4):
        for t in range(9):
            v, o, r = values[b, t].item(), old[b, t].item(), returns[b, t].item()
            plain = (v - r) ** 2
            if clip is None:
                want, want_clipped = 0.5 * plain, False
            else:
                v_clip = o + min(max(v - o, -clip), clip)
                want = 0.5 * max(plain, (v_clip - r) ** 2)
                want_clipped = (v_clip - r) ** 2 > plain
            assert loss[b, t].item() == pytest.approx(want, rel=1e-12, abs=1e-15)
            assert bool(clipped[b, t]) == want_clipped


def test_the_value_loss_is_the_token_mean_over_the_step():
    """Two micro-batches' shares of a step add up to the loss of the whole step."""
    generator = torch.Generator().manual_seed(0)
    values, old, returns = (torch.randn(4, 6, generator=generator) for _ in range(3))
    mask = (torch.rand(4, 6, generator=generator) > 0.3).float()
    whole = PolicyBatch(
        target_ids=torch.zeros(4, 6, dtype=torch.long), loss_mask=mask, values=old, returns=returns
    )
    per_token, _ = clipped_value_loss(values.double(), old.double(), returns.double(), 0.2)
    want = (per_token * mask).sum() / mask.sum()
    loss_fn = ValueLoss(0.2)
    step_tokens = mask.sum().long()
    halves = [
        loss_fn(
            values[rows, :, None], PolicyBatch(**{**whole.select(rows).__dict__, "step_tokens": step_tokens})
        ).loss
        for rows in (torch.tensor([0, 1]), torch.tensor([2, 3]))
    ]
    assert sum(halves).item() == pytest.approx(want.item(), rel=1e-5)
