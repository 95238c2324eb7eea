"""The endpoints that carry a training batch, each in its own process: the replay buffer hands
out one PolicyBatch per data-parallel rank, the reference model returns per-episode rows."""

import asyncio

import pytest
import torch

from forge.actors.reference import ReferenceModel, reference_logprobs
from forge.actors.replay_buffer import ReplayBuffer
from forge.controller import shutdown
from forge.data.tokenizer import embedded_tokenizer
from forge.data.types import Completion, Episode
from forge.engines.titan.config import TitanEngineConfig
from forge.engines.titan.engine import TitanEngine
from forge.replay_buffer import ReplayBufferConfig
from forge.rl.ops import compute_logprobs

pytestmark = pytest.mark.slow


def completion(prompt_ids: list[int], response_ids: list[int], version: int = 0) -> Completion:
    logprobs = [-0.5] * len(response_ids)
    return Completion("p", prompt_ids, response_ids, logprobs, "r", "stop", version)


COMPLETIONS = [completion([1, 5, 6, 9], [7, 8, 2]), completion([1, 9], [4]), completion([3], [5, 6, 7, 8])]


def test_replay_buffer_samples_one_policy_batch_per_rank():
    async def main():
        buffer = await ReplayBuffer.as_actor(ReplayBufferConfig(batch_size=4, seed=0), 0, 2)
        try:
            episodes = [Episode(COMPLETIONS[i % 3], "t", "g", advantage=float(i)) for i in range(4)]
            await buffer.add.route(episodes[0])
            assert await buffer.sample.route(0) is None
            await buffer.add_many.route(episodes[1:])
            return await buffer.sample.route(0)
        finally:
            await shutdown()

    batches = asyncio.run(main())
    assert len(batches) == 2 and all(b.num_rows == 2 for b in batches)
    assert sorted(a for b in batches for a in b.advantages.tolist()) == [0.0, 1.0, 2.0, 3.0]
    for batch in batches:
        batch.check()
        assert batch.policy_versions.tolist() == [0, 0]
        assert batch.generator_logprobs[batch.loss_mask != 0].eq(-0.5).all()


def test_reference_forward_returns_each_episodes_response_logprobs(tiny_policy):
    config = TitanEngineConfig.model_validate(
        {
            "model": {"flavor": "tiny", "hf_path": str(tiny_policy), "vocab_size": len(embedded_tokenizer())},
            "training": {"seq_len": 64},
        }
    )

    async def main():
        reference = await ReferenceModel.as_actor(config, 0.7)
        try:
            return await reference_logprobs(reference, COMPLETIONS)
        finally:
            await shutdown()

    rows = asyncio.run(main())
    # Each sequence alone, unpadded, in this process: the padding in the actor changes nothing.
    engine = TitanEngine(config, trainable=False)
    for c, row in zip(COMPLETIONS, rows, strict=True):
        sequence = torch.tensor([c.prompt_ids + c.response_ids])
        logprobs = compute_logprobs(engine.forward(sequence[:, :-1]), sequence[:, 1:], 0.7)[0]
        assert row == pytest.approx(logprobs[len(c.prompt_ids) - 1 :].tolist(), abs=1e-5)
