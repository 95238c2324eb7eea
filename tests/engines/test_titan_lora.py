"""TitanEngine with LoRA (``trainer.engine.lora``) on CPU with real tiny models: the adapted model
starts as its base, trains its adapters alone, is its base again under ``adapters_disabled`` (the
KL term's reference), publishes and exports merged weights, exports its adapters for PEFT, and
resumes exactly from a checkpoint that holds only the adapters. FSDP with LoRA is in
test_titan_dp.py."""

import json

import pytest
import torch
from peft import PeftModel
from pydantic import ValidationError
from safetensors.torch import load_file
from titan_testing import lm_batch, masked_ce
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

from forge.data.types import Completion
from forge.engines.titan.config import TitanEngineConfig
from forge.engines.titan.engine import TitanEngine
from forge.engines.titan.logprobs import completion_logprobs, share_logprobs
from forge.grpo.config import GRPOConfig
from forge.rl.batch import PolicyBatch
from forge.rl.losses import build_loss

VOCAB = 40
LORA = {"rank": 4, "alpha": 8.0}  # scaling 2: a scaling PEFT did not apply would show


def make_config(lora: dict | None = None, **sections) -> TitanEngineConfig:
    raw = {"model": {"vocab_size": VOCAB}, "training": {"seq_len": 64}, "lora": lora}
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return TitanEngineConfig.model_validate(raw)


def batches(count: int, start: int = 0) -> list[PolicyBatch]:
    """Different data at every step; the first third of each row is a prompt the loss ignores."""
    out = []
    for seed in range(start, start + count):
        tokens = torch.randint(0, VOCAB, (4, 18), generator=torch.Generator().manual_seed(seed))
        loss_mask = torch.ones_like(tokens, dtype=torch.bool)
        loss_mask[:, :6] = False
        out.append(lm_batch(tokens, loss_mask))
    return out


def logprobs(engine: TitanEngine, batch: PolicyBatch) -> torch.Tensor:
    return engine.score_tokens(batch.tokens, batch.target_ids, batch.loss_mask).logprobs


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny qwen3 checkpoint: the frozen base of the LoRA engines here."""
    return TitanEngine(make_config(), trainable=False).export_hf(tmp_path_factory.mktemp("base") / "qwen3")


def test_the_adapted_model_starts_as_its_base_and_trains_its_adapters_alone(base_dir):
    plain = TitanEngine(make_config(model={"hf_path": str(base_dir)}), trainable=False)
    engine = TitanEngine(make_config(LORA, model={"hf_path": str(base_dir)}))
    batch = batches(1)[0]
    # B is zero: the adapted model is its base exactly, logits and token scores alike.
    assert torch.equal(engine.forward(batch.tokens), plain.forward(batch.tokens))
    assert torch.equal(logprobs(engine, batch), logprobs(plain, batch))

    state = engine.model.state_dict()
    adapters = {name for name in state if name.endswith((".lora_A", ".lora_B"))}
    # Every linear layer of the blocks (2 layers x 7), neither the embeddings nor the output.
    assert len(adapters) == 2 * 7 * 2
    assert not any(name.startswith(("tok_embeddings", "output")) for name in adapters)
    layer = engine.model.layers["0"].attention.wq
    assert layer.lora_A.shape == (4, layer.in_features) and layer.lora_B.shape == (layer.out_features, 4)
    # PEFT's initialisation of A: uniform in +-1/sqrt(in).
    assert 0 < layer.lora_A.abs().max() <= layer.in_features**-0.5 and not layer.lora_B.any()
    trained = {name for name, p in engine.model.named_parameters() if p.requires_grad}
    assert trained == adapters
    (optimizer,) = engine.optimizers.optimizers
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for name, p in engine.model.named_parameters() if name in adapters}

    before = {name: t.clone() for name, t in state.items()}
    sft = build_loss("sft")
    for step_batch in batches(3):
        engine.train_step(step_batch, sft)  # the scoring head's path, packed
    engine.train_step(batch, masked_ce)  # logits
    after = engine.model.state_dict()
    changed = {name for name in after if not torch.equal(after[name], before[name])}
    assert changed == adapters  # the base is bit for bit the checkpoint's
    assert all(after[name].isfinite().all() for name in adapters)
    assert not torch.equal(engine.forward(batch.tokens), plain.forward(batch.tokens))
    # The optimizer's state ("state.<parameter>.<statistic>") is the adapters' alone.
    moments = {key.removeprefix("state.").rsplit(".", 1)[0] for key in engine.optimizers.state_dict()}
    assert {name for name in moments if not name.startswith("param_groups.")} == adapters


def test_adapters_disabled_is_the_base_model_exactly(base_dir):
    plain = TitanEngine(make_config(model={"hf_path": str(base_dir)}), trainable=False)
    engine = TitanEngine(make_config({**LORA, "dropout": 0.2}, model={"hf_path": str(base_dir)}))
    for batch in batches(2):
        engine.train_step(batch, build_loss("sft"))
    batch = batches(1, start=5)[0]
    adapted = logprobs(engine, batch)
    # Dropout acts in training passes only: scoring is deterministic.
    assert torch.equal(logprobs(engine, batch), adapted)
    with engine.adapters_disabled():
        assert torch.equal(logprobs(engine, batch), logprobs(plain, batch))
        assert torch.equal(engine.forward(batch.tokens), plain.forward(batch.tokens))
        base_weights = engine.hf_state_dict()
        for name, tensor in plain.hf_state_dict().items():
            assert torch.equal(base_weights[name], tensor), name
    assert torch.equal(logprobs(engine, batch), adapted) and not torch.equal(adapted, logprobs(plain, batch))


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_the_kl_reference_is_the_base_checkpoint_exactly(base_dir, compute):
    """With LoRA the trainer answers the KL term's reference calls (TitanTrainer.reference_logprobs)
    with its model's adapters off: after its adapters moved, those logprobs are, bit for bit, the
    base checkpoint's as the ReferenceModel's engine (built from the same config, not trained)
    scores them; under bfloat16 compute too, where the LoRA engine keeps its frozen weights in
    bfloat16 and the reference casts its float32 ones."""
    sections = {"model": {"hf_path": str(base_dir)}, "training": {"mixed_precision_param": compute}}
    reference = TitanEngine(make_config(LORA, **sections), trainable=False)
    engine = TitanEngine(make_config(LORA, optimizer={"lr": 0.02}, **sections))
    for batch in batches(2):
        engine.train_step(batch, build_loss("sft"))
    draw = torch.Generator().manual_seed(11)
    completions = [
        Completion("", ids[:prompt_len], ids[prompt_len:], [0.0] * (len(ids) - prompt_len), "", "stop", 0)
        for ids, prompt_len in (
            (torch.randint(0, VOCAB, (length,), generator=draw).tolist(), length // 3)
            for length in (9, 17, 12, 5)
        )
    ]
    expected = completion_logprobs(reference, completions, temperature=0.7)
    with engine.adapters_disabled():
        assert share_logprobs(engine, completions, temperature=0.7).values == expected
    assert completion_logprobs(engine, completions, temperature=0.7) != expected  # the policy moved


@pytest.mark.parametrize("model", ["qwen3", "llama3"])
def test_peft_loads_the_adapter_export_onto_the_base_export(tmp_path, model):
    """llama3: torchtitan permutes its q/k rows for Hugging Face, and B's rows must follow."""
    lora = {**LORA, "dropout": 0.1, "target_modules": "q_proj|k_proj|o_proj|up_proj|down_proj"}
    # A high learning rate: adapters that change the logits by far more than the tolerance.
    engine = TitanEngine(make_config(lora, model={"name": model}, optimizer={"lr": 0.02}))
    for batch in batches(3):
        engine.train_step(batch, masked_ce)
    tokens = batches(1, start=7)[0].tokens
    with engine.adapters_disabled():
        base = engine.export_hf(tmp_path / "base")
        base_logits = engine.forward(tokens)
    assert (engine.forward(tokens) - base_logits).abs().max() > 0.1
    out = engine.export_peft(tmp_path / "adapter", base_model_name_or_path=str(base))

    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8.0, 0.1)
    assert config["target_modules"] == ["down_proj", "k_proj", "o_proj", "q_proj", "up_proj"]
    assert config["base_model_name_or_path"] == str(base)
    tensors = load_file(out / "adapter_model.safetensors")
    assert len(tensors) == 2 * 5 * 2
    assert tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"].shape == (4, 64)

    hf_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf_model, out).eval()
    with torch.no_grad():
        peft_logits = peft_model(tokens).logits
    torch.testing.assert_close(peft_logits, engine.forward(tokens), rtol=0, atol=1e-4)


def test_weights_read_by_name_are_merged(tmp_path, base_dir):
    engine = TitanEngine(
        make_config({**LORA, "target_modules": "v_proj|gate_proj"}, model={"hf_path": str(base_dir)})
    )
    for batch in batches(3):
        engine.train_step(batch, masked_ce)
    base = load_file(base_dir / "model.safetensors")
    layers = engine.model.layers
    adapted = {
        f"model.layers.{i}.{hf}.weight": getattr(getattr(layers[str(i)], block), titan)
        for i in range(2)
        for hf, block, titan in (
            ("self_attn.v_proj", "attention", "wv"),
            ("mlp.gate_proj", "feed_forward", "w1"),
        )
    }

    out = engine.export_hf(tmp_path / "merged")
    exported = load_file(out / "model.safetensors")
    assert exported.keys() == base.keys()  # under the model's own names, no adapters
    for name, tensor in exported.items():
        if name in adapted:
            layer = adapted[name]
            expected = base[name] + 2.0 * layer.lora_B.detach() @ layer.lora_A.detach()
            torch.testing.assert_close(tensor, expected, rtol=0, atol=1e-6, msg=name)
            assert not torch.equal(tensor, base[name]), name
        else:
            assert torch.equal(tensor, base[name]), name
    # What the generators get: the same weights, cast (and through the row-shard path too).
    published = engine.hf_state_dict(torch.bfloat16)
    shards = engine.hf_row_shards(torch.bfloat16)
    for name, tensor in exported.items():
        assert torch.equal(published[name], tensor.bfloat16()), name
        assert torch.equal(shards.tensors[name], tensor.bfloat16()) and shards.first_rows[name] == 0, name

    hf_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokens = batches(1, start=7)[0].tokens
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, engine.forward(tokens), rtol=0, atol=1e-4)


def test_a_checkpoint_holds_the_adapters_alone_and_resumes_exactly(tmp_path, base_dir):
    def config(seed: int) -> TitanEngineConfig:
        # A decaying LR with warmup: a resume that lost the scheduler state would change the losses.
        return make_config(
            LORA,
            model={"hf_path": str(base_dir)},
            training={"seed": seed},
            lr_scheduler={"warmup_steps": 2, "decay_type": "cosine", "total_steps": 10},
        )

    def train(engine: TitanEngine, data: list[PolicyBatch]) -> list[float]:
        return [engine.train_step(batch, masked_ce)["train/loss"] for batch in data]

    first = TitanEngine(config(seed=0))
    train(first, batches(2))
    first.save_to(tmp_path / "trainer", extra_state={"cursor": 2})
    expected = train(first, batches(2, start=2))

    # Another seed: other fresh adapters, the same base (the checkpoint's).
    resumed = TitanEngine(config(seed=7))
    assert resumed.load_from(tmp_path / "trainer") == {"cursor": 2} and resumed.step == 2
    assert train(resumed, batches(2, start=2)) == expected
    final = first.model.state_dict()
    for name, tensor in resumed.model.state_dict().items():
        assert torch.equal(tensor, final[name]), name

    saved = FileSystemReader(tmp_path / "trainer").read_metadata().state_dict_metadata
    weights = {key for key in saved if key.startswith("model.")}
    assert weights == {f"model.{name}" for name in final if name.endswith((".lora_A", ".lora_B"))}
    assert all("lora_" in key for key in saved if key.startswith("optimizer.state."))


def test_frozen_weights_stay_in_bfloat16_under_bfloat16_compute(base_dir):
    bf16 = {"mixed_precision_param": "bfloat16"}
    plain = TitanEngine(make_config(model={"hf_path": str(base_dir)}, training=bf16), trainable=False)
    engine = TitanEngine(make_config(LORA, model={"hf_path": str(base_dir)}, training=bf16))
    dtypes = {name: p.dtype for name, p in engine.model.named_parameters()}
    assert {dtypes[name] for name, p in engine.model.named_parameters() if p.requires_grad} == {torch.float32}
    assert {dtypes[name] for name, p in engine.model.named_parameters() if not p.requires_grad} == {
        torch.bfloat16
    }
    # Computing in bfloat16 rounds every weight as keeping it in bfloat16 does.
    tokens = batches(1)[0].tokens
    assert torch.equal(engine.forward(tokens), plain.forward(tokens))

    before = {name: t.clone() for name, t in engine.model.state_dict().items()}
    for batch in batches(2):
        assert engine.train_step(batch, build_loss("sft"))["train/skipped"] == 0
    changed = {name for name, t in engine.model.state_dict().items() if not torch.equal(t, before[name])}
    assert changed == {name for name in before if "lora_" in name}
    # A merged weight keeps the adapters' float32 update.
    merged = engine.hf_state_dict()
    assert merged["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32
    assert merged["model.norm.weight"].dtype == torch.bfloat16


def test_lora_is_the_trained_engine_only():
    """The reference model is built from the trainer's engine config: it is the base model."""
    reference = TitanEngine(make_config(LORA), trainable=False)
    assert reference.adapters is None
    assert not any("lora_" in name for name in reference.model.state_dict())
    plain = TitanEngine(make_config())
    for refused in (plain.adapters_disabled, lambda: plain.export_peft("unused")):
        with pytest.raises(RuntimeError, match="built without lora"):
            with refused():
                pass


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ({"rank": 0}, r"lora\.rank\n.*greater than 0"),
        ({"target_modules": "qkv_proj"}, r"lora\.target_modules\n.*matches none of the linear layers q_proj"),
        ({"target_modules": "(q_proj"}, r"lora\.target_modules\n.*not a regular expression"),
        ({"dropout": 1.0}, r"lora\.dropout\n.*less than 1"),
    ],
)
def test_config_refusals_name_the_key(lora, message):
    with pytest.raises(ValidationError, match=message):
        make_config(lora)


def test_a_pattern_that_matches_no_layer_of_the_model_is_refused():
    """A mixture of experts has no gate/up/down projections (its experts are grouped tensors)."""
    lora = {"target_modules": "gate_proj|up_proj"}
    with pytest.raises(
        ValueError, match=r"lora\.target_modules .* matches no linear layer .*: k_proj, o_proj"
    ):
        TitanEngine(make_config(lora, model={"flavor": "debugmodel_moe"}))


def test_config_refusals_name_the_key_in_a_run_config():
    raw = {"policy_path": "unused", "trainer": {"engine": {"lora": {"target_modules": "lm_head"}}}}
    with pytest.raises(ValidationError, match=r"trainer\.engine\.lora\.target_modules\n"):
        GRPOConfig.model_validate(raw)
    with pytest.raises(ValidationError, match="lora does not support parallelism.tensor_parallel_degree > 1"):
        make_config(LORA, parallelism={"tensor_parallel_degree": 2})
    assert make_config({"target_modules": "q_proj|v_proj"}).lora.targets() == ["q_proj", "v_proj"]
