"""What the GRPO config derives at start-up: the loss's fixed horizon and the trainer's
data-parallel size (no process is started)."""

import pytest
from apps.grpo.config import GRPOConfig

from forge.config import parse_args


def load(write_grpo_config, *overrides: str) -> GRPOConfig:
    return parse_args(GRPOConfig, ["--config", str(write_grpo_config()), *overrides])


def test_fixed_horizon_defaults_to_the_generators_max_tokens(write_grpo_config):
    # The test config's GRPO loss aggregates with fixed_horizon (its default) and samples 4 tokens.
    assert load(write_grpo_config).trainer.loss.params["horizon"] == 4
    assert load(write_grpo_config, "generator.sampling.max_tokens=7").trainer.loss.params["horizon"] == 7
    explicit = load(write_grpo_config, "trainer.loss.params.horizon=16")
    assert explicit.trainer.loss.params["horizon"] == 16
    assert (
        "horizon"
        not in load(write_grpo_config, "trainer.loss.params.agg_type=token_mean").trainer.loss.params
    )
    assert "horizon" not in load(write_grpo_config, "trainer.loss={name: dapo}").trainer.loss.params


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
