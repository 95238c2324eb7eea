"""What the GRPO config derives and refuses at start-up: the values it fills in from other
settings (the loss's fixed horizon and temperature, the generator's model, the run's files), the
trainer's data-parallel size, and the hosts and sequence length that the trainer's and the
reference model's processes need (no process is started)."""

import re
from pathlib import Path

import pytest

from forge.config import load_config, parse_args, save_config
from forge.config.errors import ConfigError
from forge.grpo.config import GRPOConfig


def load(write_grpo_config, *overrides: str) -> GRPOConfig:
    return parse_args(GRPOConfig, ["--config", str(write_grpo_config()), *overrides])


def test_unset_values_follow_the_settings_they_copy():
    config = Path(__file__).resolve().parents[2] / "configs" / "grpo" / "tiny_cpu.yaml"
    cfg = load_config(GRPOConfig, config, ["generator.sampling.temperature=0.7", "output_dir=runs/x"])
    assert cfg.generator.model_path == cfg.trainer.engine.model.hf_path == cfg.policy_path
    assert cfg.trainer.loss.temperature == 0.7
    assert cfg.generator.sampling.seed == cfg.seed
    assert (cfg.metrics.jsonl_path, cfg.metrics.rollouts_path) == (
        "runs/x/metrics.jsonl",
        "runs/x/rollouts.jsonl",
    )
    explicit = load_config(
        GRPOConfig,
        config,
        [
            "generator.model_path=elsewhere",
            "trainer.engine.model.hf_path=null",
            "metrics.jsonl_path=m.jsonl",
            "metrics.rollouts_path=null",
            "generator.sampling.seed=null",
        ],
    )
    assert explicit.generator.model_path == "elsewhere" and explicit.trainer.engine.model.hf_path is None
    assert (explicit.metrics.jsonl_path, explicit.metrics.rollouts_path) == ("m.jsonl", None)
    assert explicit.generator.sampling.seed is None


@pytest.mark.parametrize("name", ["tiny_cpu", "tool_cpu", "gpu_demo"])
def test_a_saved_config_reads_back_as_the_same_config(name, tmp_path):
    """A run's config.yaml spells every value, derived ones included (a replay or a later run
    starts from it)."""
    config = load_config(
        GRPOConfig, Path(__file__).resolve().parents[2] / "configs" / "grpo" / f"{name}.yaml"
    )
    assert load_config(GRPOConfig, save_config(config, tmp_path / "config.yaml")) == config


def test_fixed_horizon_defaults_to_the_generators_max_tokens(write_grpo_config):
    # The test config's GRPO loss aggregates with fixed_horizon (its default) and samples 4 tokens.
    assert load(write_grpo_config).trainer.loss.horizon == 4
    assert load(write_grpo_config, "generator.sampling.max_tokens=7").trainer.loss.horizon == 7
    explicit = load(write_grpo_config, "trainer.loss.horizon=16")
    assert explicit.trainer.loss.horizon == 16
    assert load(write_grpo_config, "trainer.loss.agg_type=token_mean").trainer.loss.horizon is None
    assert load(write_grpo_config, "trainer.loss={name: dapo}").trainer.loss.horizon is None
    # An agent's sequences hold every call: the horizon is the trainer's sequence length.
    assert load(write_grpo_config, "agent.function=agent_programs:two_calls").trainer.loss.horizon == 64


@pytest.mark.parametrize(
    ("procs", "parallelism", "dp_size"),
    [
        (1, [], 1),
        (4, [], 4),
        (4, ["trainer.engine.parallelism.tensor_parallel_degree=2"], 2),
        (4, ["trainer.engine.parallelism.tensor_parallel_degree=4"], 1),
        (
            4,
            [
                "trainer.engine.parallelism.data_parallel_replicate_degree=2",
                "trainer.engine.parallelism.tensor_parallel_degree=2",
            ],
            2,
        ),
    ],
)
def test_dp_size_is_derived_from_procs_and_parallelism(write_grpo_config, procs, parallelism, dp_size):
    assert load(write_grpo_config, f"trainer.procs={procs}", *parallelism).dp_size == dp_size


def test_batch_must_split_over_the_dp_ranks_not_the_procs(write_grpo_config, capsys):
    tp = "trainer.engine.parallelism.tensor_parallel_degree=2"
    # 6 episodes over 4 procs in 2 tensor-parallel pairs: 3 per data-parallel rank.
    assert load(write_grpo_config, "trainer.procs=4", tp, "replay_buffer.batch_size=6").dp_size == 2
    with pytest.raises(SystemExit):
        load(write_grpo_config, "trainer.procs=4", "replay_buffer.batch_size=6")
    assert "replay_buffer.batch_size (6) must be a multiple of the trainer's data-parallel size (4" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        load(write_grpo_config, "trainer.procs=3", tp)
    assert "tensor_parallel_degree (2) must equal the world size (3)" in capsys.readouterr().err


def test_the_reference_spans_the_trainers_hosts_and_a_placement_it_cannot_span_is_refused():
    """The reference model has the trainer's processes and hosts; unlisted, it takes the
    trainer's placement, and a listed one must begin with trainer.hosts consecutive hosts."""
    from pydantic import ValidationError

    trainer = {"engine": {"model": {"flavor": "tiny"}}, "hosts": 2, "loss": {"beta": 0.1}}
    hosts = [f"tcp://h{i}:1" for i in range(3)]

    def validate(placement: dict, beta: float = 0.1) -> GRPOConfig:
        return GRPOConfig.model_validate(
            {
                "policy_path": "p",
                "generator": {"model_path": "p"},
                "trainer": {**trainer, "loss": {"beta": beta}},
                "provisioner": {"hosts": hosts, "placement": placement},
            }
        )

    cfg = validate({"TitanTrainer": [1, 2]})
    assert cfg.use_reference and cfg.provisioner.placement_for("ReferenceModel") == [1, 2]
    for listed in ([2], [2, 0]):
        with pytest.raises(
            ValidationError,
            match=re.escape(
                f"provisioner.placement.ReferenceModel ({listed}) must begin with trainer.hosts (2) "
            )
            + "consecutive host indices",
        ):
            validate({"TitanTrainer": [0, 1], "ReferenceModel": listed})
    # Without a KL term there is no reference model to place.
    validate({"TitanTrainer": [0, 1], "ReferenceModel": [2]}, beta=0.0)
    # With LoRA the trainer is the reference (its base model): no ReferenceModel to place either,
    # unless there is no trainer (rollout-only), whose reference is a ReferenceModel again.
    trainer["engine"]["lora"] = {"rank": 4}
    lora = validate({"TitanTrainer": [0, 1], "ReferenceModel": [2]})
    assert (lora.use_reference, lora.reference_in_trainer, lora.reference_actor) == (True, True, False)
    trainer["enabled"] = False
    rollout_only = validate({"TitanTrainer": [1, 2]})
    assert (rollout_only.reference_in_trainer, rollout_only.reference_actor) == (False, True)
    del trainer["enabled"], trainer["engine"]["lora"]
    # The trainer's own placement is held to the same rule (unlisted, it is host 0 alone).
    with pytest.raises(
        ValidationError, match=re.escape("provisioner.placement.TitanTrainer ([0]) must begin")
    ):
        validate({}, beta=0.0)


def test_a_seq_len_that_sequence_parallelism_cannot_split_is_refused(write_grpo_config, capsys):
    tp = "trainer.engine.parallelism.tensor_parallel_degree=2"
    assert load(write_grpo_config, "trainer.procs=2", tp).dp_size == 1  # seq_len 64
    with pytest.raises(SystemExit):
        load(write_grpo_config, "trainer.procs=2", tp, "trainer.engine.training.seq_len=66")
    assert "training.seq_len (66) must be a multiple of 2 * parallelism.tensor_parallel_degree (4)" in (
        capsys.readouterr().err
    )


def test_resume_accepts_auto_and_refuses_other_words(write_grpo_config):
    config = write_grpo_config()
    assert load_config(GRPOConfig, config, ["resume=auto"]).resume == "auto"
    with pytest.raises(ConfigError, match="resume"):
        load_config(GRPOConfig, config, ["resume=maybe"])


def test_a_profile_step_that_no_later_step_would_close_is_refused(write_grpo_config, capsys):
    # The test config runs 3 steps: a profile of step 2 closes as step 3 starts.
    assert load(write_grpo_config, "trainer.profile_step=2").trainer.profile_step == 2
    with pytest.raises(SystemExit):
        load(write_grpo_config, "trainer.profile_step=3")
    assert "trainer.profile_step (3) must be below max_steps (3)" in capsys.readouterr().err


def test_token_advantage_settings_resolve_what_they_need(write_grpo_config, tiny_policy):
    """REINFORCE++'s KL penalty turns the reference model on; a teacher turns the skipping of
    groups without reward signal off (it has a signal in every group) unless set; the teacher's
    engine is the trainer's with the teacher's checkpoint and no adapters."""
    plain = load(write_grpo_config, "trainer.loss.beta=0")
    assert not plain.use_reference and plain.token_advantages is None and plain.teacher_engine is None
    reinforce = load(
        write_grpo_config, "trainer.loss.beta=0", "rollout.advantage=reinforce_pp", "rollout.kl_coef=0.1"
    )
    assert reinforce.use_reference
    assert (reinforce.token_advantages.reinforce_pp, reinforce.token_advantages.kl_coef) == (True, 0.1)
    unset = "~rollout.skip_groups_without_signal"  # the test config sets it
    assert load(write_grpo_config, unset).rollout.skip_groups_without_signal is True
    distill = load(write_grpo_config, unset, f"distill.teacher_path={tiny_policy}", "distill.weight=0.5")
    assert distill.rollout.skip_groups_without_signal is False
    assert distill.token_advantages.distill_weight == 0.5 and not distill.token_advantages.reinforce_pp
    assert distill.teacher_engine.model.hf_path == str(tiny_policy) and distill.teacher_engine.lora is None
    assert distill.teacher_engine.training == distill.trainer.engine.training
    kept = load(
        write_grpo_config, f"distill.teacher_path={tiny_policy}", "rollout.skip_groups_without_signal=true"
    )
    assert kept.rollout.skip_groups_without_signal is True


def test_a_critic_resolves_its_engine_its_optimizer_and_gaes_settings(write_grpo_config, tiny_teacher):
    """A critic (rollout.advantage gae) trains with its own optimizer settings, each unset one the
    trainer's; its engine is the trainer's with the policy's model (or critic.path) and no
    adapters; GAE's gamma and lam reach the token advantages; groups of one are allowed, and the
    skipping of groups without reward spread is off unless set (the critic's baseline gives
    every group a signal)."""
    gae = ["rollout.advantage=gae", "critic.optimizer.lr=0.003", "critic.gamma=0.9", "critic.lam=0.5"]
    unset = "~rollout.skip_groups_without_signal"
    cfg = load(
        write_grpo_config, *gae, unset, "rollout.group_size=1", "trainer.engine.optimizer.weight_decay=0.1"
    )
    assert (cfg.critic.optimizer.lr, cfg.critic.optimizer.weight_decay) == (0.003, 0.1)
    engine = cfg.critic_engine
    assert engine.optimizer == cfg.critic.optimizer and engine.lora is None
    assert engine.model == cfg.trainer.engine.model and engine.training == cfg.trainer.engine.training
    advantages = cfg.token_advantages
    assert (advantages.gae.gamma, advantages.gae.lam, advantages.reinforce_pp) == (0.9, 0.5, False)
    assert cfg.rollout.group_size == 1 and cfg.rollout.skip_groups_without_signal is False
    assert cfg.critic.value_clip == 0.2  # PPO's default
    elsewhere = load(write_grpo_config, "rollout.advantage=gae", f"critic.path={tiny_teacher}")
    assert elsewhere.critic_engine.model.hf_path == str(tiny_teacher)
    assert elsewhere.critic_engine.optimizer == elsewhere.trainer.engine.optimizer
    assert (
        load(write_grpo_config, "rollout.advantage=gae", "critic.value_clip=null").critic.value_clip is None
    )
    # REINFORCE++ needs no group either.
    assert (
        load(write_grpo_config, "rollout.advantage=reinforce_pp", "rollout.group_size=1").rollout.group_size
        == 1
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.advantage=gae"], "rollout.advantage=gae needs a critic: add a `critic` section"),
        (["critic={}"], "critic is set and rollout.advantage is grpo: only gae uses a critic's values"),
        (
            ["rollout.group_size=1"],
            "rollout.group_size=1 with rollout.advantage=grpo: a group advantage of one",
        ),
        (
            ["rollout.group_size=1", "rollout.advantage=rloo"],
            "rollout.group_size=1 with rollout.advantage=rloo",
        ),
        (
            [
                "rollout.group_size=1",
                "rollout.advantage=gae",
                "critic={}",
                "rollout.skip_groups_without_signal=true",
            ],
            "rollout.skip_groups_without_signal=true drops every group of one completion",
        ),
        (
            [
                "rollout.advantage=gae",
                "critic={}",
                "trainer.procs=2",
                "trainer.engine.parallelism.tensor_parallel_degree=2",
            ],
            "critic: the value model does not support trainer.engine.parallelism.tensor_parallel_degree",
        ),
        (["rollout.advantage=gae", "critic.gamma=1.5"], "critic.gamma"),
    ],
)
def test_critic_settings_that_cannot_work_are_refused_naming_the_keys(
    write_grpo_config, capsys, overrides, message
):
    with pytest.raises(SystemExit):
        load(write_grpo_config, *overrides)
    assert message in capsys.readouterr().err
