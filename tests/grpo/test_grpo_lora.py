"""The GRPO app with LoRA (`trainer.engine.lora`): the trainer publishes its adapters alone, through
the weight store, checked by checksums, and the generator merges them on arrival, so that it
samples exactly the policy the trainer scores, while the policy moves away from the reference (the
frozen base). The reference is the trainer's own model with its adapters off: no ReferenceModel
actor starts, and the run in sync mode is the serial recipe's (which loads merged weights), bit
for bit."""

import json
import logging
import re

import pytest
import torch
from apps.grpo.main import main
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from forge.config import load_config
from forge.engines.titan.engine import TitanEngine
from forge.engines.titan.logprobs import completion_logprobs
from forge.grpo.config import GRPOConfig
from forge.recipes.grpo_replay import episode_from_record
from forge.recipes.grpo_serial import grpo_serial
from forge.rollout.records import decode_floats, read_records

pytestmark = pytest.mark.slow

# Sync mode (one rollout loop, episodes of the current policy only, one torch thread per
# process), where the app is the serial recipe step for step; groups with a learning signal only
# (seed 3 finds them), so that every step changes the adapters.
SYNC_LORA = [
    "trainer.engine.lora.rank=8",
    "seed=3",
    "actor_threads=1",
    "replay_buffer.max_policy_age=0",
    "rollout.threads=1",
    "rollout.skip_groups_without_signal=true",
    "eval.every=0",
    "max_steps=2",
    # Through the store itself (not a one-host handle), checksummed: what crosses it is counted.
    "generator.weight_transport=store",
    "generator.verify_weights=true",
]
COMPARED = ("train/loss", "loss/pg", "loss/kl", "loss/ratio_mean", "train/grad_norm", "buffer/sampled_reward")


def test_generators_sample_the_merged_policy_and_the_trainer_is_the_reference(grpo_config_factory, caplog):
    config = grpo_config_factory()
    with caplog.at_level(logging.INFO, logger="forge.controller.provisioner"):
        main(["--config", str(config), *SYNC_LORA])
    started = [m.group(1) for r in caplog.records if (m := re.search(r"started mesh (\w+):", r.getMessage()))]
    assert any(name.startswith("TitanTrainer") for name in started), started
    assert not any(name.startswith("ReferenceModel") for name in started), started

    cfg = load_config(GRPOConfig, config, SYNC_LORA)
    out = config.parent / "run"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss/mismatch_kl" in row]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        # Episodes of the current policy only: a ratio away from 1 would be the sync's fault.
        assert row["loss/mismatch_kl"] < 1e-6 and abs(row["loss/ratio_max"] - 1) < 1e-4, row
        assert row["reference/forward_s"] > 0, row  # the trainer's reference pass, timed
    # Only the adapters crossed the store: rank x (in + out) float32s for each adapted layer.
    shapes = [
        t.shape for name, t in load_file(f"{cfg.policy_path}/model.safetensors").items() if "_proj." in name
    ]
    adapter_bytes = sum(4 * 8 * (rows + cols) for rows, cols in shapes)
    synced = [row for row in rows if "weight_sync/publish_bytes" in row]
    assert synced and all(row["weight_sync/publish_bytes"] == adapter_bytes for row in synced), synced
    pulled = [row for row in rows if "generator/weight_sync_bytes" in row]
    assert pulled and all(row["generator/weight_sync_bytes"] % adapter_bytes == 0 for row in pulled), pulled
    assert any("weight_sync/verify_s" in row for row in rows)  # checksums compared (and equal: it ran)

    # B starts at zero: the policy is the reference at step 1, then the adapters move it (the
    # trainer's adapters were off for the reference, or the KL would stay 0).
    assert steps[0]["loss/kl"] < 1e-9 < steps[1]["loss/kl"] < 1, steps

    # The recorded reference logprobs are the base checkpoint's, scored here by the engine a
    # ReferenceModel runs (one call per rollout there, all at once here: equal to rounding).
    records = [r for r in read_records(out / "rollouts.jsonl") if not r["eval"]]
    assert len(records) >= 16 and all(r["ref_logprobs"] is not None for r in records)
    completions = [episode_from_record(r).completion for r in records]
    base = TitanEngine(cfg.trainer.engine, trainable=False)
    expected = completion_logprobs(base, completions, cfg.generator.sampling.temperature)
    for record, row in zip(records, expected, strict=True):
        torch.testing.assert_close(
            torch.tensor(decode_floats(record["ref_logprobs"])), torch.tensor(row), rtol=0, atol=1e-5
        )

    # The run's exports: the merged model, and the adapter alone, which peft loads onto the
    # checkpoint the run started from to give the merged model's logits.
    merged = AutoModelForCausalLM.from_pretrained(out / "export", torch_dtype=torch.float32)
    start = AutoModelForCausalLM.from_pretrained(cfg.policy_path, torch_dtype=torch.float32)
    ids = torch.tensor([list(completions[0].prompt_ids) + list(completions[0].response_ids)])
    with torch.no_grad():
        moved = (start(ids).logits - merged(ids).logits).abs().max()
        adapted = PeftModel.from_pretrained(start, out / "export_adapter")  # into `start`'s modules
        error = (adapted(ids).logits - merged(ids).logits).abs().max()
    assert error < 1e-4 < moved, (error, moved)

    serial = grpo_serial(cfg)
    assert len({row["train/loss"] for row in serial["metrics"]}) == 2  # not a comparison of constants
    for want, got in zip(serial["metrics"], steps, strict=True):
        for key in COMPARED:
            assert got[key] == want[key], (
                f"step {want['step']}: {key} {got[key]} != {want[key]} (serial recipe)"
            )
