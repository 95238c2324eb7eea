"""TitanEngine on CPU with real (tiny) TorchTitan models: training, HF weights, export, errors.

Checkpointing is in test_titan_checkpoint.py, data parallelism in test_titan_dp.py.
"""

import json

import pytest
import torch
from pydantic import ValidationError
from titan_testing import LossOutput, lm_batch, masked_ce
from transformers import AutoModelForCausalLM

from forge.data.tokenizer import build_char_tokenizer
from forge.engines.titan.config import TitanEngineConfig
from forge.engines.titan.engine import TitanEngine
from forge.rl.batch import PolicyBatch

VOCAB = 40


def make_batch(size: int = 8, length: int = 24, seed: int = 0) -> PolicyBatch:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (size, length), generator=generator)
    loss_mask = torch.ones(size, length, dtype=torch.bool)
    loss_mask[:, : length // 3] = False  # a prompt the loss ignores
    return lm_batch(tokens, loss_mask)


def make_config(**sections) -> TitanEngineConfig:
    raw = {"model": {"vocab_size": VOCAB}, "training": {"seq_len": 64}}
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return TitanEngineConfig.model_validate(raw)


def test_training_lowers_the_loss_on_a_fixed_batch():
    engine = TitanEngine(make_config())
    batch = make_batch()
    metrics = [engine.train_step(batch, masked_ce) for _ in range(6)]
    losses = [m["train/loss"] for m in metrics]
    assert losses[-1] < losses[0] - 0.5, losses
    last = metrics[-1]
    assert last["train/step"] == engine.step == 6
    assert last["loss/nll"] == pytest.approx(last["train/loss"])
    assert last["train/tokens"] == batch.tokens.numel()
    assert last["train/lr"] == pytest.approx(1e-3)
    assert last["train/grad_norm"] > 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_loss_skips_the_update_and_says_so(bad):
    engine = TitanEngine(make_config())
    batch = make_batch()
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}

    def poisoned(logits, batch):
        out = masked_ce(logits, batch)
        return LossOutput(out.loss * bad, out.metrics)

    metrics = engine.train_step(batch, poisoned)
    assert metrics["train/skipped"] == 1.0 and engine.step == 1
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, before[name]), name
    # The next good step trains from clean gradients.
    good = engine.train_step(batch, masked_ce)
    assert good["train/skipped"] == 0.0 and torch.isfinite(torch.tensor(good["train/grad_norm"]))
    assert all(torch.isfinite(p).all() for p in engine.model.parameters())
    assert any(not torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())


def ragged_batch(size: int = 4, length: int = 12) -> PolicyBatch:
    """Rows with 1, 3, 5, ... loss tokens: a mean of microbatch means would weigh them unequally."""
    batch = make_batch(size, length)
    batch.loss_mask = torch.zeros_like(batch.loss_mask)
    for row in range(size):
        batch.loss_mask[row, 2 : 3 + 2 * row] = True
    return batch


def grads(engine: TitanEngine) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in engine.model.named_parameters()}


def test_gradient_and_metrics_do_not_depend_on_the_microbatch_size():
    """token_mean over the whole step: microbatches of 1, 2 and all rows give the same gradient,
    the same token-weighted loss, and a max that is the max over every token."""
    batch = ragged_batch()
    engines = {size: TitanEngine(make_config()) for size in (None, 2, 1)}
    with torch.no_grad():
        logits = engines[None].forward(batch.tokens).double()
    nll = -torch.log_softmax(logits, -1).gather(-1, batch.target_ids[..., None])[..., 0]
    mask = batch.loss_mask
    results = {
        size: engine.train_step(batch, masked_ce, microbatch_size=size) for size, engine in engines.items()
    }
    for size in (2, 1):
        for name, grad in grads(engines[size]).items():
            torch.testing.assert_close(grad, grads(engines[None])[name], rtol=1e-5, atol=1e-7, msg=name)
    for metrics in results.values():
        assert metrics["train/loss"] == pytest.approx(float(nll[mask].mean()), rel=1e-5)
        assert metrics["loss/nll"] == pytest.approx(metrics["train/loss"], rel=1e-6)
        assert metrics["loss/nll_max"] == pytest.approx(float(nll[mask].max()), rel=1e-5)
        assert metrics["train/tokens"] == batch.tokens.numel()


def test_lr_schedule_warms_up_and_decays():
    engine = TitanEngine(
        make_config(lr_scheduler={"warmup_steps": 2, "decay_type": "linear", "total_steps": 4})
    )
    lrs = [engine.train_step(make_batch(2), masked_ce)["train/lr"] for _ in range(5)]
    # torchtitan's schedule: linear warmup, the peak held one step, then decay to 0 at step 4.
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4, 0.0])


def test_hf_state_dict_round_trip_gives_identical_logits():
    trained = TitanEngine(make_config())
    trained.train_step(make_batch(), masked_ce)
    hf_sd = {name: t.clone() for name, t in trained.hf_state_dict().items()}
    assert "model.embed_tokens.weight" in hf_sd and "lm_head.weight" not in hf_sd  # tied

    fresh = TitanEngine(make_config(training={"seed": 1}), trainable=False)
    tokens = make_batch().tokens
    assert not torch.equal(fresh.forward(tokens), trained.forward(tokens))
    fresh.load_hf_state_dict(hf_sd)
    logits = fresh.forward(tokens)
    assert logits.shape == (*tokens.shape, VOCAB) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, trained.forward(tokens), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("model", "architecture"), [("qwen3", "Qwen3ForCausalLM"), ("llama3", "LlamaForCausalLM")]
)
def test_export_loads_in_transformers_with_matching_logits(tmp_path, model, architecture):
    engine = TitanEngine(make_config(model={"name": model}))
    engine.train_step(make_batch(), masked_ce)
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer = build_char_tokenizer("0123456789+=")
    tokenizer.save_pretrained(tokenizer_dir)

    out = engine.export_hf(tmp_path / "export", tokenizer_dir=tokenizer_dir)
    engine.export_hf(out)  # replacing an export goes through a temporary dir as well
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "tokenizer"]
    engine.export_hf(out, tokenizer_dir=tokenizer_dir)
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }

    config = json.loads((out / "config.json").read_text())
    # The tokenizer's special ids go into the config, so transformers' generate stops at eos.
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id
    assert config["architectures"] == [architecture]
    assert config["vocab_size"] == VOCAB and config["head_dim"] == 16
    assert config["tie_word_embeddings"] is (model == "qwen3")
    hf_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(hf_model).__name__ == architecture
    tokens = make_batch().tokens
    with torch.no_grad():
        hf_logits = hf_model(tokens).logits
    torch.testing.assert_close(hf_logits, engine.forward(tokens), rtol=0, atol=1e-4)

    # Reloaded from the export, the trainer's model is the one transformers loads from it, exactly
    # (for llama3 not bit for bit the flavor's model: torchtitan's llama3 rotates complex pairs).
    reloaded = TitanEngine(make_config(model={"name": model, "hf_path": str(out)}), trainable=False)
    torch.testing.assert_close(reloaded.forward(tokens), hf_logits, rtol=0, atol=0)


def test_reference_engine_has_no_optimizer_and_no_grad():
    engine = TitanEngine(make_config(), trainable=False)
    assert engine.optimizers is None
    assert not any(p.requires_grad for p in engine.model.parameters())
    assert not engine.forward(make_batch().tokens).requires_grad
    with pytest.raises(RuntimeError, match="trainable=False"):
        engine.train_step(make_batch(), masked_ce)


def test_missing_hf_path_names_the_path(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(FileNotFoundError, match="no-such-checkpoint"):
        TitanEngine(make_config(model={"hf_path": str(missing)}))
    missing.mkdir()
    with pytest.raises(FileNotFoundError, match=r"no-such-checkpoint has no config\.json"):
        TitanEngine(make_config(model={"hf_path": str(missing)}))


def test_wrong_shapes_and_keys_are_named(tmp_path):
    out = TitanEngine(make_config()).export_hf(tmp_path / "v40")
    with pytest.raises(ValueError, match=r"model\.vocab_size is 48 but .*v40/config\.json has vocab_size 40"):
        TitanEngine(make_config(model={"vocab_size": 48, "hf_path": str(out)}))

    engine = TitanEngine(make_config(), trainable=False)
    hf_sd = dict(engine.hf_state_dict())
    hf_sd.pop("model.norm.weight")
    hf_sd["model.extra.weight"] = torch.zeros(1)
    with pytest.raises(
        ValueError, match=r"missing keys \['model.norm.weight'\]; unexpected keys \['model.extra.weight'\]"
    ):
        engine.load_hf_state_dict(hf_sd)


def test_unknown_flavor_lists_known_flavors():
    with pytest.raises(ValueError, match=r"unknown flavor 'huge'.*'tiny', 'small'.*'debugmodel'"):
        TitanEngine(make_config(model={"flavor": "huge"}))


def test_config_rejects_unknown_keys_and_incomplete_schedules():
    with pytest.raises(ValidationError, match="lr_rate"):
        make_config(optimizer={"lr_rate": 1.0})
    with pytest.raises(ValidationError, match="needs lr_scheduler.total_steps"):
        make_config(lr_scheduler={"decay_type": "cosine"})


def test_policy_batch_split_checks_the_batch():
    batch = make_batch(4)
    assert [mb.tokens.shape[0] for mb in batch.split(2)] == [2, 2]
    assert [mb.tokens.shape[0] for mb in batch.split(None)] == [4]
    assert make_batch(0).split(2) == [] and make_batch(0).split(None) == []  # no empty microbatch
    with pytest.raises(ValueError, match="not a multiple"):
        batch.split(3)
    batch.advantages = torch.zeros(3)
    with pytest.raises(ValueError, match=r"advantages has shape \[3\], expected \[4\]"):
        batch.split(2)


def test_hf_state_dict_in_another_dtype_leaves_the_master_weights():
    engine = TitanEngine(make_config())
    engine.train_step(make_batch(), masked_ce)
    master = {name: t.clone() for name, t in engine.hf_state_dict().items()}
    cast = engine.hf_state_dict(torch.bfloat16)
    assert cast.keys() == master.keys()
    for name, tensor in master.items():
        assert tensor.dtype == torch.float32
        assert cast[name].dtype == torch.bfloat16 and torch.equal(cast[name], tensor.bfloat16()), name
    # The float32 parameters are untouched, and training goes on from them.
    for name, tensor in engine.hf_state_dict().items():
        assert torch.equal(tensor, master[name]), name
