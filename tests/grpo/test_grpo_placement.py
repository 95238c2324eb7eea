"""A GRPO config as a request to the placement planner, refused before any process starts."""

from pathlib import Path

import pytest
from safetensors.torch import load_file

from forge.config import load_config
from forge.config.errors import ConfigError
from forge.controller.gpu_plan import GENERATOR_GROUP, TRAINER_GROUP, Machine, PlacementError, plan_gpus
from forge.grpo.config import GRPOConfig
from forge.runs.placement import grpo_gpu_plan, placement_request, policy_settings, trainer_state_gib


def test_grpo_config_request_counts_the_trainer_state(write_grpo_config):
    config = write_grpo_config()
    cfg = load_config(
        GRPOConfig, config, ["trainer.procs=2", "generator.replicas=2", "provisioner.colocate=true"]
    )
    settings = policy_settings(cfg.trainer.engine.model)
    request = placement_request(cfg, settings)
    assert (request.trainer_procs, request.generator_replicas, request.colocate) == (2, 2, True)
    assert request.attention_heads == (settings["num_attention_heads"], settings["num_key_value_heads"])
    # float32 weights, gradients, two moments and the reference's weights (beta > 0), over 2 shards.
    count = sum(t.numel() for t in load_file(str(Path(cfg.policy_path) / "model.safetensors")).values())
    assert trainer_state_gib(cfg, settings) == pytest.approx(count * 4 * 5 / 2 / 2**30)
    # A teacher (distill) shares the trainer's GPUs: its weights count too.
    teacher = load_config(GRPOConfig, config, ["trainer.procs=2", f"distill.teacher_path={cfg.policy_path}"])
    assert trainer_state_gib(teacher, settings) == pytest.approx(count * 4 * 6 / 2 / 2**30)
    # So does a critic (PPO): its weights, gradients and two moments.
    critic = load_config(GRPOConfig, config, ["trainer.procs=2", "critic={}", "rollout.advantage=gae"])
    assert trainer_state_gib(critic, settings) == pytest.approx(count * 4 * 9 / 2 / 2**30)


def test_a_teacher_on_gpus_of_its_own_comes_after_the_generators(write_grpo_config):
    config = write_grpo_config()
    base = load_config(GRPOConfig, config, ["provisioner.colocate=false"])
    own = ["provisioner.colocate=false", f"distill.teacher_path={base.policy_path}", "distill.gpu=own"]
    cfg = load_config(GRPOConfig, config, [*own, "distill.procs=2"])
    settings = policy_settings(cfg.trainer.engine.model)
    # Its weights are not the trainer's GPUs' to hold; its engine is sharded over its own processes.
    assert trainer_state_gib(cfg, settings) == trainer_state_gib(base, settings)
    assert cfg.teacher_engine.parallelism.data_parallel_shard_degree == -1
    plan = grpo_gpu_plan(cfg, ["0", "1", "2", "3"])
    assert (plan.slots[TRAINER_GROUP], plan.slots[GENERATOR_GROUP]) == ([[0]], [[1]])
    assert plan.own_gpus == {"teacher": [2, 3]} and "teacher: GPU 2,3" in plan.describe()
    with pytest.raises(
        PlacementError, match=r"trainer.procs \(1\) \+ generator.replicas \(1\) .* \+ teacher \(2\) = 4 GPUs"
    ):
        grpo_gpu_plan(cfg, ["0", "1", "2"])
    with pytest.raises(ConfigError, match="distill.procs .2. applies to a teacher on GPUs of its own"):
        load_config(GRPOConfig, config, [f"distill.teacher_path={base.policy_path}", "distill.procs=2"])


def test_a_run_that_does_not_fit_the_gpus_is_refused_naming_keys(write_grpo_config):
    cfg = load_config(GRPOConfig, write_grpo_config(), ["trainer.procs=2", "generator.replicas=2"])
    plan = grpo_gpu_plan(cfg, ["0", "1", "2", "3"])
    assert (plan.slots[TRAINER_GROUP], plan.slots[GENERATOR_GROUP]) == ([[0, 1]], [[2], [3]])
    with pytest.raises(PlacementError, match=r"trainer.procs \(2\) \+ generator.replicas \(2\)"):
        grpo_gpu_plan(cfg, ["0", "1", "2"])
    assert grpo_gpu_plan(cfg, []) is None  # no GPUs: nothing to place


def test_the_8b_config_fits_four_80_gb_gpus_colocated_and_says_what_does_not(tiny_policy):
    from forge.engines.titan.checkpoint_model import model_settings, parameter_count
    from forge.engines.titan.flavors import resolve_model_args

    config = Path(__file__).resolve().parents[2] / "configs" / "grpo" / "qwen3_8b.yaml"
    cfg = load_config(GRPOConfig, config, [f"policy_path={tiny_policy}", "dataset.path=prompts.jsonl"])
    settings = model_settings(resolve_model_args("qwen3", "8B"))  # Qwen3-8B's shape
    assert 8.1e9 < parameter_count(settings) < 8.3e9
    request = placement_request(cfg, settings)
    assert 30 < request.trainer_gib < 31  # a quarter of float32 weights, gradients and AdamW moments
    plan = plan_gpus(request, Machine(4, memory_gib=79.6))  # an H100's 81,559 MiB
    assert (plan.slots[TRAINER_GROUP], plan.slots[GENERATOR_GROUP]) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    # On 4 GPUs of 40 GB the trainer's quarter and vLLM's share do not fit.
    with pytest.raises(PlacementError, match=r"GPU 0 \(40 GiB\) cannot hold"):
        plan_gpus(request, Machine(4, memory_gib=40))
    # The 8-GPU variant its comment gives.
    eight = load_config(
        GRPOConfig,
        config,
        [
            f"policy_path={tiny_policy}",
            "dataset.path=prompts.jsonl",
            "trainer.procs=8",
            "generator.replicas=8",
            "rollout.threads=16",
        ],
    )
    plan = plan_gpus(placement_request(eight, settings), Machine(8, memory_gib=79.6))
    assert plan.slots[GENERATOR_GROUP] == [[i] for i in range(8)]


def test_the_8b_lora_config_fits_one_80_gb_gpu_where_full_training_does_not(tiny_policy):
    """LoRA's trainer holds the frozen base once in bfloat16 and its adapters' float32 state;
    the same run training every weight needs float32 weights, gradients, AdamW moments and a
    reference copy, which one GPU cannot hold."""
    from forge.engines.titan.checkpoint_model import (
        lora_parameter_count,
        model_settings,
        parameter_count,
    )
    from forge.engines.titan.flavors import resolve_model_args

    config = Path(__file__).resolve().parents[2] / "configs" / "grpo" / "qwen3_8b_lora.yaml"
    overrides = [f"policy_path={tiny_policy}", "dataset.path=prompts.jsonl"]
    cfg = load_config(GRPOConfig, config, overrides)
    assert cfg.reference_in_trainer and not cfg.reference_actor
    settings = model_settings(resolve_model_args("qwen3", "8B"))
    # Rank 32 over the 7 linear layers of 36 blocks: 32 x (in + out) summed.
    hidden, inter, q, kv = 4096, 12288, 32 * 128, 8 * 128
    per_block = 32 * ((hidden + q) * 2 + (hidden + kv) * 2 + (hidden + inter) * 3)
    assert lora_parameter_count(settings, cfg.trainer.engine.lora.targets(), 32) == 36 * per_block
    request = placement_request(cfg, settings)
    expected = (parameter_count(settings) * 2 + 36 * per_block * 4 * 4) / 2**30
    assert request.trainer_gib == pytest.approx(expected) and 16 < expected < 17
    plan = plan_gpus(request, Machine(1, memory_gib=79.6))
    assert (plan.slots[TRAINER_GROUP], plan.slots[GENERATOR_GROUP]) == ([[0]], [[0]])

    full = load_config(GRPOConfig, config, [*overrides, "trainer.engine.lora=null"])
    assert full.reference_actor
    with pytest.raises(PlacementError, match=r"GPU 0 \(80 GiB\) cannot hold"):
        plan_gpus(placement_request(full, settings), Machine(1, memory_gib=79.6))
