"""Generator and trainer agree after a weight sync; stale episodes give real off-policy ratios.
A sharded trainer publishes without gathering: two FSDP ranks (gloo) each put their own rows
in their own shared-memory slots, or broadcast them (gloo groups standing in for NCCL's), and
two generator replicas each assemble the whole version from both, checksummed against the
trainer's, and then sample exactly the trainer's policy."""

import asyncio

import pytest
import torch

from forge import store
from forge.actors.generator import Generator, GeneratorConfig
from forge.actors.trainer import TitanTrainer
from forge.controller import shutdown
from forge.data.tokenizer import embedded_tokenizer
from forge.data.types import Episode
from forge.engines.titan.config import TitanEngineConfig
from forge.rl.batch import PolicyBatch
from forge.rl.losses import GRPOLossConfig
from forge.weight_transports import IpcTransport

pytestmark = pytest.mark.slow

# Rendered by the caller, as every prompt is (the generator samples from ids).
PROMPTS = [embedded_tokenizer()(p).input_ids for p in ["12+34=", "7+8=", "55+5=", "9+90=", "3+4=", "61+20="]]


def episodes_from(groups) -> list[Episode]:
    # Alternating signs give the surrogate both clip sides to work with.
    return [
        Episode(c, target="0", group_id=str(g), advantage=1.0 if i % 2 else -1.0)
        for g, group in enumerate(groups)
        for i, c in enumerate(group)
    ]


def max_masked_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).max())


def test_parity_after_sync_and_off_policy_ratios(tiny_policy):
    engine = TitanEngineConfig.model_validate(
        {
            "model": {"flavor": "tiny", "hf_path": str(tiny_policy), "vocab_size": len(embedded_tokenizer())},
            "training": {"seq_len": 64},
            "optimizer": {"lr": 0.05},
        }
    )

    async def main():
        await store.initialize()
        trainer = await TitanTrainer.as_actor(engine, GRPOLossConfig())
        generator = await Generator.as_actor(
            GeneratorConfig(model_path=str(tiny_policy), sampling={"max_tokens": 6, "seed": 0})
        )
        try:
            stale = episodes_from(await generator.generate.route(PROMPTS, n=4))
            assert {e.policy_version for e in stale} == {0}

            # Step 1 is on-policy: the trainer's logprobs equal the generator's, ratio 1.
            first = await trainer.train_step.route([PolicyBatch.from_episodes(stale[:12], pad_id=0)])
            assert abs(first["loss/ratio_mean"] - 1.0) < 1e-4 and first["loss/ratio_max"] < 1 + 1e-4

            # Step 2 trains on episodes the old policy produced: the ratio sees the change.
            second = await trainer.train_step.route([PolicyBatch.from_episodes(stale[12:], pad_id=0)])
            assert abs(second["loss/ratio_mean"] - 1.0) > 1e-3
            assert second["loss/mismatch_kl"] > 1e-6
            assert {"loss/clip_frac_low", "loss/clip_frac_high"} <= second.keys()

            # After a sync the generator samples from exactly the trainer's distribution.
            await trainer.push_weights.route(2)
            await generator.update_weights.route(2)
            # A generator that starts now (a replaced replica) loads the newest weights first.
            late = await Generator.as_actor(GeneratorConfig(model_path=str(tiny_policy)))
            assert await late.get_version.route() == 2
            fresh = episodes_from(await generator.generate.route(PROMPTS, n=4))
            assert {e.policy_version for e in fresh} == {2}
            [single] = await generator.generate.route(PROMPTS[:1], n=3, max_tokens=2)
            assert len(single) == 3 and all(c.policy_version == 2 and c.response_len <= 2 for c in single)
            batch = PolicyBatch.from_episodes(fresh, pad_id=0)
            trainer_logprobs = await trainer.compute_logprobs.route(batch.tokens, batch.target_ids)
            assert max_masked_diff(trainer_logprobs, batch.generator_logprobs, batch.loss_mask) < 1e-4
            # ...and not from the stale one (the comparison above can fail).
            batch = PolicyBatch.from_episodes(stale, pad_id=0)
            trainer_logprobs = await trainer.compute_logprobs.route(batch.tokens, batch.target_ids)
            assert max_masked_diff(trainer_logprobs, batch.generator_logprobs, batch.loss_mask) > 1e-3
        finally:
            await store.shutdown()
            await shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("transport", ["shm", "broadcast"])
def test_two_fsdp_ranks_publish_their_rows_and_two_replicas_get_the_whole_policy(tiny_policy, transport):
    engine = TitanEngineConfig.model_validate(
        {
            "model": {"flavor": "tiny", "hf_path": str(tiny_policy), "vocab_size": len(embedded_tokenizer())},
            "training": {"seq_len": 64},
            "optimizer": {"lr": 0.05},
            "parallelism": {"data_parallel_shard_degree": 2},
        }
    )
    generator_config = GeneratorConfig(
        model_path=str(tiny_policy),
        weight_transport=transport,
        verify_weights=True,
        sampling={"max_tokens": 6, "seed": 0},
    )

    async def main():
        await store.initialize()
        trainer = await TitanTrainer.options(procs=2).as_actor(
            engine, GRPOLossConfig(), weight_transport=transport, verify_weights=True
        )
        generators = await Generator.options(num_replicas=2).as_service(generator_config)
        try:
            sampled = episodes_from((await generators.generate.fanout(PROMPTS, n=4))[0])
            started = PolicyBatch.from_episodes(sampled, pad_id=0)
            half = len(sampled) // 2
            await trainer.train_step.route(
                [PolicyBatch.from_episodes(e, pad_id=0) for e in (sampled[:half], sampled[half:])]
            )
            await trainer.push_weights.route(1)
            await trainer.wait_published.route()
            if transport == "shm":  # version 1 is each rank's rows: the embedding's halves
                handle = await store.get_object(1, IpcTransport.PREFIX)
                vocab = len(embedded_tokenizer())
                assert [part.first_rows["model.embed_tokens.weight"] for part in handle.parts] == [
                    0,
                    -(-vocab // 2),
                ]
            # Each replica loads it, its checksum compared with the trainer's (a mismatch raises).
            await generators.update_weights.fanout(1)
            for replica_samples in await generators.generate.fanout(PROMPTS, n=4):
                fresh = episodes_from(replica_samples)
                assert {e.policy_version for e in fresh} == {1}
                batch = PolicyBatch.from_episodes(fresh, pad_id=0)
                trained = await trainer.compute_logprobs.route(batch.tokens, batch.target_ids)
                assert max_masked_diff(trained, batch.generator_logprobs, batch.loss_mask) < 1e-4
                # The comparison can fail: these are not the logprobs the replicas started with.
                assert max_masked_diff(trained, started.generator_logprobs, started.loss_mask) > 1e-3
        finally:
            await store.shutdown()
            await shutdown()

    asyncio.run(main())
