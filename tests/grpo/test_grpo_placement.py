"""A GRPO config as a request to the placement planner, refused before any process starts."""

import json
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from forge.config import load_config
from forge.config.errors import ConfigError
from forge.controller.gpu_plan import GENERATOR_GROUP, TRAINER_GROUP, Machine, PlacementError, plan_gpus
from forge.grpo.config import GRPOConfig
from forge.runs.placement import (
    check_kv_cache,
    grpo_gpu_plan,
    idle_replicas_line,
    kv_cache_line,
    placement_request,
    policy_settings,
    trainer_state_gib,
)


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


def test_the_8b_config_fits_four_80_gb_gpus_and_colocated_it_is_refused_as_measured(tiny_policy):
    """On 4 H100s the config's first colocated version (a trainer rank and a replica with an
    8 GiB KV cache on each GPU) ran out of memory at its first publish: the replica's process
    held 43.15 GiB, its weights twice (vLLM's and the receive buffers). The planner refuses it
    now, and passes the shipped 3 + 1 split and the variants the config's comment gives."""
    from forge.engines.titan.checkpoint_model import model_settings, parameter_count
    from forge.engines.titan.flavors import resolve_model_args

    config = Path(__file__).resolve().parents[2] / "configs" / "grpo" / "qwen3_8b.yaml"
    base = [f"policy_path={tiny_policy}", "dataset.path=prompts.jsonl"]
    settings = model_settings(resolve_model_args("qwen3", "8B"))  # Qwen3-8B's shape
    assert 8.1e9 < parameter_count(settings) < 8.3e9
    h100, h200 = 79.6, 140.4  # 81,559 and 143,771 MiB

    def request(*overrides: str):
        return placement_request(load_config(GRPOConfig, config, [*base, *overrides]), settings)

    shipped = request()
    assert 40 < shipped.trainer_gib < 41  # a third of float32 weights, gradients and AdamW moments
    assert 10 < shipped.trainer_buffers_gib < 10.5  # two slots of a third of the bf16 weights
    assert 15 < shipped.generator_buffers_gib < 15.5  # the bf16 weights, once
    plan = plan_gpus(shipped, Machine(4, memory_gib=h100))
    assert (plan.slots[TRAINER_GROUP], plan.slots[GENERATOR_GROUP]) == ([[0, 1, 2]], [[3]])

    colocated = [
        "provisioner.colocate=true",
        "trainer.procs=4",
        "generator.replicas=4",
        "generator.vllm.gpu_memory_utilization=0.35",
    ]
    measured = request(*colocated, "generator.vllm.kv_cache_memory_gib=8")
    replica = measured.generator_gib + measured.generator_buffers_gib
    assert replica == pytest.approx(43.15, abs=0.1)  # what the replica's process held
    with pytest.raises(
        PlacementError, match=r"GPU 0 \(80 GiB\) cannot hold .*receive buffers .*colocate=false"
    ):
        plan_gpus(measured, Machine(4, memory_gib=h100))
    on_h200 = request(*colocated, "generator.vllm.kv_cache_memory_gib=16")
    assert plan_gpus(on_h200, Machine(4, memory_gib=h200)).slots[GENERATOR_GROUP] == [[0], [1], [2], [3]]
    eight = request("trainer.procs=4", "generator.replicas=4", "rollout.threads=16")
    plan = plan_gpus(eight, Machine(8, memory_gib=h100))
    assert plan.slots[GENERATOR_GROUP] == [[4], [5], [6], [7]]
    # On 4 GPUs of 40 GB not even the trainer's third fits.
    with pytest.raises(PlacementError, match=r"GPU 0 \(40 GiB\) cannot hold"):
        plan_gpus(shipped, Machine(4, memory_gib=40))


def test_the_weight_copies_follow_the_transport_tensor_parallelism_and_lora(write_grpo_config):
    from forge.engines.titan.checkpoint_model import model_settings, parameter_count
    from forge.engines.titan.flavors import resolve_model_args
    from forge.runs.placement import VLLM_RUNTIME_GIB, weight_copies_gib

    settings = model_settings(resolve_model_args("qwen3", "8B"))
    weights = parameter_count(settings) * 2 / 2**30  # bf16

    def copies(*overrides: str) -> tuple[float, float, float | None]:
        base = ["generator.dtype=bfloat16", "trainer.procs=2", "generator.vllm.kv_cache_memory_gib=10"]
        return weight_copies_gib(load_config(GRPOConfig, write_grpo_config(), [*base, *overrides]), settings)

    trainer, receive, in_vllm = copies()  # auto: CUDA IPC, two slots of each rank's half
    assert (trainer, receive) == pytest.approx((weights, weights))
    assert in_vllm == pytest.approx(weights + 10 + VLLM_RUNTIME_GIB)
    trainer, receive, _ = copies("generator.weight_transport=broadcast")  # one buffer a side more
    assert (trainer, receive) == pytest.approx((weights / 2, 2 * weights))
    trainer, receive, in_vllm = copies("generator.vllm.tensor_parallel_size=2")  # host receive buffers
    assert receive == 0 and in_vllm == pytest.approx(weights / 2 + 10 + VLLM_RUNTIME_GIB)
    assert copies("generator.weight_transport=store")[:2] == (0, weights)
    assert copies("generator.vllm.kv_cache_memory_gib=null")[2] is None  # vLLM takes its share


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


def test_the_kv_cache_line_says_when_a_replica_is_given_more_samples_than_its_cache_holds(write_grpo_config):
    config = write_grpo_config()
    vllm = ["generator.engine=vllm", "generator.vllm.max_model_len=64"]

    def line(*overrides: str, on_gpu: bool = True) -> str | None:
        return kv_cache_line(load_config(GRPOConfig, config, [*vllm, *overrides]), on_gpu)

    small = ["generator.vllm.kv_cache_memory_gib=0.001"]
    holds = int(re.search(r"([\d,]+) samples of 64 ", line(*small)).group(1).replace(",", ""))
    # A sample fits the trainer's sequence (seq_len 64 here) whatever vLLM would admit.
    assert f"{holds:,} samples of 64 " in line(small[0], "generator.vllm.max_model_len=128")
    # Rollouts of half what the cache holds, a train batch each.
    half = [f"rollout.prompts_per_step={holds // 8}", f"replay_buffer.batch_size={holds // 2}"]
    # Two threads over two replicas: one rollout a replica.
    fits = line(*small, *half, "generator.replicas=2")
    assert f"up to {holds // 2} samples at once (2 rollouts at once" in fits and "preempts" not in fits
    # Five threads over two replicas, three of them on one replica...
    five = [*small, *half, "generator.replicas=2", "rollout.threads=5"]
    over = line(*five, "replay_buffer.max_policy_age=4")
    assert f"up to {holds // 2 * 3} samples at once (5 rollouts at once" in over
    # ...as many as the staleness bound lets be made ahead: max_policy_age 1, two batches.
    assert f"up to {holds // 2} samples at once (2 rollouts at once" in line(*five)
    raised = re.search(r"Past [\d,]+, vLLM preempts .*\.kv_cache_memory_gib to ([\d.]+) ", over)
    # The size it names holds them all.
    enough = f"generator.vllm.kv_cache_memory_gib={raised.group(1)}"
    assert "preempts" not in line(*five, "replay_buffer.max_policy_age=4", enough)
    # Under drain, once the trainer is ahead a replica runs one rollout at a time (bench/RESULTS.md,
    # issue 28): the line says so wherever a replica is given more than one.
    assert f"a replica runs one rollout at a time ({holds // 2} samples)" in over
    assert "one rollout at a time" not in fits
    assert "one rollout at a time" not in line(
        *five, "replay_buffer.max_policy_age=4", "generator.update_mode=in_flight"
    )
    # Tensor parallelism splits the key/value heads over the replica's GPUs, each with that cache.
    tokens = [
        int(re.search(r"holds ([\d,]+) tokens", text).group(1).replace(",", ""))
        for text in (line(*small), line(*small, "generator.vllm.tensor_parallel_size=2"))
    ]
    assert "0.001 GiB on each of its 2 GPUs" in line(*small, "generator.vllm.tensor_parallel_size=2")
    assert 0 <= tokens[1] - 2 * tokens[0] <= 1
    # Without a fixed size on a GPU, vLLM sizes its cache at start-up; the hf engine has none.
    assert line() is None and line("generator.engine=hf", *small) is None
    # On CPU vLLM's cache is forge's default size.
    assert "tokens (0.25 GiB)" in line(on_gpu=False)


def test_replicas_that_no_rollout_would_keep_busy_or_that_wait_for_the_trainer_are_named(write_grpo_config):
    config = write_grpo_config()

    def line(*overrides: str, on_gpu: bool = True) -> str | None:
        cfg = load_config(GRPOConfig, config, ["generator.replicas=4", *overrides])
        return idle_replicas_line(cfg, on_gpu)

    # Each rollout is a whole batch of 8: max_policy_age 1 lets two be made ahead of training.
    whole = ["rollout.threads=4", "rollout.prompts_per_step=2", "replay_buffer.batch_size=8"]
    assert re.search(r"idle: 2 rollout\(s\) run at once .* of the 4 generator.replicas", line(*whole))
    # Two threads: two replicas idle whatever the bound.
    assert "idle: 2 rollout(s)" in line("replay_buffer.max_policy_age=3")
    # max_policy_age 3 gives each replica a rollout and none more: a replica whose rollout ends
    # waits for a train step and its publish. One rollout of slack, at the age the line names, ends it.
    assert "wait for the trainer: replay_buffer.max_policy_age 3 lets 4 x batch_size 8" in line(
        *whole, "replay_buffer.max_policy_age=3"
    )
    assert "max_policy_age 4 lets it start at once" in line(*whole, "replay_buffer.max_policy_age=3")
    assert line(*whole, "replay_buffer.max_policy_age=4") is None
    # Half a batch a rollout: max_policy_age 1 lets 4 be made ahead, 2 the slack of a fifth.
    split = ["rollout.threads=4", "rollout.prompts_per_step=1", "replay_buffer.batch_size=8"]
    assert "max_policy_age 2 lets it start at once" in line(*split)
    assert line(*split, "replay_buffer.max_policy_age=2") is None
    # On policy, each rollout waits for the step before by design: not named.
    assert line(*split, "replay_buffer.max_policy_age=0", "replay_buffer.batch_size=16") is None
    # One replica beside the trainer (colocated) takes turns with it on the GPU anyway; on a GPU
    # of its own it idles as the trainer trains. (Rollouts of two batches, max_policy_age 1.)
    one = [
        "generator.replicas=1",
        "rollout.threads=2",
        "rollout.prompts_per_step=4",
        "replay_buffer.batch_size=8",
    ]
    assert line(*one, "provisioner.colocate=true") is None
    assert "max_policy_age 2 lets it start at once" in line(*one)
    # On CPU every actor shares the cores: not named; replicas no rollout keeps busy are.
    assert line(*one, on_gpu=False) is None
    assert "idle: 2 rollout(s)" in line("replay_buffer.max_policy_age=3", on_gpu=False)


def test_a_kv_cache_that_cannot_hold_one_sample_is_refused_before_any_process_starts(
    write_grpo_config, tmp_path
):
    config = write_grpo_config()

    def check(*overrides: str) -> None:
        check_kv_cache(load_config(GRPOConfig, config, ["generator.engine=vllm", *overrides]), True)

    small = "generator.vllm.kv_cache_memory_gib=0.001"  # 2,097 tokens of the tiny policy
    check(small, "generator.vllm.max_model_len=2048")
    with pytest.raises(ValueError, match="kv_cache_memory_gib 0.001 holds 2,097 tokens") as refused:
        check(small, "generator.vllm.max_model_len=4096")
    # Either way out that it names starts.
    raised = re.search(r"raise kv_cache_memory_gib to ([\d.]+),", str(refused.value)).group(1)
    check(f"generator.vllm.kv_cache_memory_gib={raised}", "generator.vllm.max_model_len=4096")
    check(small, "generator.vllm.max_model_len=2097")
    # Without max_model_len, the model's own length is the one vLLM admits.
    policy = load_config(GRPOConfig, config, []).policy_path
    longest = json.loads((Path(policy) / "config.json").read_text())["max_position_embeddings"]
    tiny = f"generator.vllm.kv_cache_memory_gib={0.0005 * longest / 2097}"  # half a sample of it
    with pytest.raises(
        ValueError, match=f"max_model_len {longest:,} .* else the length the model's config.json gives"
    ):
        check(tiny)
    # vLLM takes the shortest length a config.json gives.
    shorter = tmp_path / "shorter"
    shutil.copytree(policy, shorter)
    settings = json.loads((shorter / "config.json").read_text())
    (shorter / "config.json").write_text(json.dumps({**settings, "seq_length": longest // 4}))
    check(tiny, f"generator.model_path={shorter}")
