"""The reference model with the trainer's parallelism: two processes, FSDP over gloo
(data_parallel_shard_degree 2, set explicitly, which a one-process reference refused), give the
logprobs one process gives, for an odd number of completions (one rank takes more than the
other) and for one (a rank with none still joins the forward's collectives)."""

import asyncio

import pytest
import torch

from forge.actors.reference import ReferenceModel, reference_logprobs
from forge.controller import shutdown
from forge.data.tokenizer import embedded_tokenizer
from forge.data.types import Completion
from forge.engines.titan.config import TitanEngineConfig
from forge.engines.titan.engine import TitanEngine
from forge.engines.titan.logprobs import completion_logprobs

pytestmark = pytest.mark.slow

TEMPERATURE = 0.7


def completions(count: int, seed: int) -> list[Completion]:
    """Prompts and responses of different lengths, so that each rank pads its share differently."""
    generator = torch.Generator().manual_seed(seed)
    vocab = len(embedded_tokenizer())

    def ids(low: int, high: int) -> list[int]:
        length = int(torch.randint(low, high, (1,), generator=generator))
        return torch.randint(0, vocab, (length,), generator=generator).tolist()

    made = []
    for _ in range(count):
        response = ids(1, 8)
        made.append(Completion("p", ids(2, 12), response, [0.0] * len(response), "r", "stop", 0))
    return made


ODD, ONE = completions(5, seed=1), completions(1, seed=2)


def engine_config(policy, shard_degree: int) -> TitanEngineConfig:
    return TitanEngineConfig.model_validate(
        {
            "model": {"flavor": "tiny", "hf_path": str(policy), "vocab_size": len(embedded_tokenizer())},
            "training": {"seq_len": 64},
            "parallelism": {"data_parallel_shard_degree": shard_degree},
        }
    )


@pytest.fixture(scope="module")
def two_ranks(tiny_policy):
    """Everything the reference actor answered, from one mesh of two processes (the trainer's
    procs): the raw shares of the odd list, then each list alone and both at once."""

    async def main():
        reference = await ReferenceModel.options(procs=2).as_actor(engine_config(tiny_policy, 2), TEMPERATURE)
        try:
            shares = sorted(await reference.reference_logprobs.route_per_rank(ODD))
            odd = await reference_logprobs(reference, ODD)
            one = await reference_logprobs(reference, ONE)
            # Two calls in flight, as from two rollout loops: each rank must run them in one order.
            together = await asyncio.gather(
                reference_logprobs(reference, ODD), reference_logprobs(reference, ONE)
            )
            return {"shares": shares, "odd": odd, "one": one, "together": together}
        finally:
            await shutdown()

    return asyncio.run(main())


@pytest.fixture(scope="module")
def one_process(tiny_policy):
    """The same model in this process, whole (world size 1); its process group goes with the
    module (tests/conftest.py)."""
    engine = TitanEngine(engine_config(tiny_policy, -1), trainable=False)
    return {
        "odd": completion_logprobs(engine, ODD, TEMPERATURE),
        "one": completion_logprobs(engine, ONE, TEMPERATURE),
    }


def assert_rows_close(got: list[list[float]], expected: list[list[float]]) -> None:
    assert [len(row) for row in got] == [len(row) for row in expected]
    for got_row, expected_row in zip(got, expected, strict=True):
        torch.testing.assert_close(torch.tensor(got_row), torch.tensor(expected_row), rtol=0, atol=1e-5)


def test_each_fsdp_rank_computes_its_share(two_ranks):
    # Two data-parallel ranks: 5 completions split 3 + 2, in order.
    assert [(s.rank, s.ranks, len(s.values)) for s in two_ranks["shares"]] == [(0, 2, 3), (1, 2, 2)]
    assert [row for s in two_ranks["shares"] for row in s.values] == two_ranks["odd"]


def test_fsdp_reference_matches_one_process_for_an_odd_count(two_ranks, one_process):
    assert_rows_close(two_ranks["odd"], one_process["odd"])


def test_fsdp_reference_matches_one_process_when_a_rank_has_no_share(two_ranks, one_process):
    assert_rows_close(two_ranks["one"], one_process["one"])


def test_concurrent_calls_each_get_their_own_rows(two_ranks, one_process):
    odd, one = two_ranks["together"]
    assert_rows_close(odd, one_process["odd"])
    assert_rows_close(one, one_process["one"])
