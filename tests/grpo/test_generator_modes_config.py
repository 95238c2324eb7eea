"""What the config refuses about how vLLM takes new weights and sleeps (no process is started)."""

import pytest

from forge.config import parse_args
from forge.grpo.config import GRPOConfig


def load(write_grpo_config, *overrides: str) -> GRPOConfig:
    return parse_args(GRPOConfig, ["--config", str(write_grpo_config()), *overrides])


def test_in_flight_updates_and_sleep_need_vllm(write_grpo_config, capsys):
    assert load(write_grpo_config, "generator.update_mode=in_flight").generator.update_mode == "in_flight"
    for setting in ("generator.update_mode=in_flight", "generator.vllm.sleep_during_train=true"):
        with pytest.raises(SystemExit):
            load(write_grpo_config, "generator.engine=hf", setting)
        assert f"{setting} needs generator.engine=vllm" in capsys.readouterr().err


def test_a_kept_cache_is_an_in_flight_setting(write_grpo_config, capsys):
    keep = "generator.vllm.in_flight_kv_cache=keep"
    assert (
        load(write_grpo_config, "generator.update_mode=in_flight", keep).generator.vllm.in_flight_kv_cache
        == "keep"
    )
    with pytest.raises(SystemExit):
        load(write_grpo_config, keep)
    assert (
        "generator.vllm.in_flight_kv_cache=keep says what an in-flight update does to the running "
        "requests' caches, and generator.update_mode is drain" in capsys.readouterr().err
    )


def test_sleeping_through_train_steps_needs_a_serial_pipeline_on_one_gpu(write_grpo_config, capsys):
    sleep = ["generator.vllm.sleep_during_train=true", "replay_buffer.max_policy_age=0"]
    assert load(write_grpo_config, *sleep, "provisioner.colocate=true").generator.vllm.sleep_during_train
    with pytest.raises(SystemExit):
        load(write_grpo_config, "generator.vllm.sleep_during_train=true", "replay_buffer.max_policy_age=1")
    err = capsys.readouterr().err
    assert "generator.vllm.sleep_during_train=true: replay_buffer.max_policy_age is 1" in err
    assert "provisioner.colocate is false" in err
    with pytest.raises(SystemExit):
        load(write_grpo_config, *sleep, "provisioner.colocate=true", "generator.replicas=2")
    assert "generator.replicas is 2: use 1" in capsys.readouterr().err


def test_lora_sync_needs_lora_and_vllm_lora_needs_vllm_draining(write_grpo_config, capsys):
    lora = "trainer.engine.lora.rank=8"
    assert load(write_grpo_config, lora).adapter_sync.mode == "merge"  # the default with LoRA
    assert load(write_grpo_config).adapter_sync is None
    sync = load(
        write_grpo_config, lora, "generator.engine=vllm", "generator.lora_sync=vllm_lora"
    ).adapter_sync
    assert (sync.mode, sync.rank, sync.vllm_max_lora_rank) == ("vllm_lora", 8, 8)

    refused = {
        ("generator.lora_sync=merge",): "generator.lora_sync=merge says how generators take the trainer's "
        "LoRA adapters, and trainer.engine.lora is not set",
        (lora, "generator.lora_sync=vllm_lora", "generator.engine=hf"): "generator.lora_sync=vllm_lora is "
        "vLLM's own LoRA serving, and generator.engine is hf",
        # No CUDA here: auto takes the native engine.
        (lora, "generator.lora_sync=vllm_lora"): "generator.lora_sync=vllm_lora needs the vLLM engine, and "
        "generator.engine=auto takes the native (hf) engine here",
        (
            lora,
            "generator.lora_sync=vllm_lora",
            "generator.engine=vllm",
            "generator.update_mode=in_flight",
        ): "generator.lora_sync=vllm_lora with generator.update_mode=in_flight",
    }
    for overrides, message in refused.items():
        with pytest.raises(SystemExit):
            load(write_grpo_config, *overrides)
        assert message in capsys.readouterr().err


def test_with_lora_the_generator_serves_the_trainers_base(write_grpo_config, tmp_path, capsys):
    """The generators apply the adapters to their own checkpoint: another one is refused."""
    other = f"generator.model_path={tmp_path}"
    assert load(write_grpo_config, other).generator.model_path == str(tmp_path)  # no LoRA: any
    with pytest.raises(SystemExit):
        load(write_grpo_config, "trainer.engine.lora.rank=8", other)
    assert (
        f"generator.model_path ({tmp_path}) differs from trainer.engine.model.hf_path"
        in capsys.readouterr().err
    )
