"""HFGenerateEngine on a tiny, randomly initialized Qwen3 built locally."""

import pytest
import torch
from transformers import Qwen3Config

from forge.engines.generation import GenerationEngine, SamplingParams
from forge.engines.hf_generate import HFGenerateEngine

EOS = 2
# Different lengths in one batch exercise left padding and position ids.
PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11], [1, 12, 13], [1]]


def tiny_config(tie_word_embeddings: bool = True) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
    )


def make_engine(seed: int = 0, **config_overrides) -> HFGenerateEngine:
    torch.manual_seed(seed)
    return HFGenerateEngine.from_config(tiny_config(**config_overrides))


@pytest.fixture(scope="module")
def engine() -> HFGenerateEngine:
    return make_engine()


def reference_logprobs(engine: HFGenerateEngine, prompt: list[int], response: list[int], temperature: float):
    """log_softmax(logits / temperature) at the response tokens, from one plain forward
    over prompt + response: no cache, no padding."""
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1 : -1]
    return logprobs.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_is_a_generation_engine(engine):
    assert isinstance(engine, GenerationEngine)


def test_n_samples_per_prompt_and_logprobs_match_a_plain_forward(engine):
    params = SamplingParams(n=3, temperature=0.7, max_tokens=12, seed=0)
    out = engine.generate(PROMPTS, params)
    assert len(out) == len(PROMPTS)
    for prompt, samples in zip(PROMPTS, out, strict=True):
        assert len(samples) == params.n
        for sample in samples:
            assert 1 <= len(sample.token_ids) <= params.max_tokens
            assert len(sample.logprobs) == len(sample.token_ids)
            expected = reference_logprobs(engine, prompt, sample.token_ids, params.temperature)
            torch.testing.assert_close(torch.tensor(sample.logprobs), expected, atol=1e-4, rtol=0)


def test_eos_stops_a_sequence_and_max_tokens_bounds_the_rest(engine):
    params = SamplingParams(n=4, temperature=2.0, max_tokens=25, seed=3)
    without_eos = HFGenerateEngine(engine.model, eos_token_id=[]).generate(PROMPTS, params)
    with_eos = engine.generate(PROMPTS, params)
    stops = 0
    for samples_free, samples in zip(without_eos, with_eos, strict=True):
        for free, sample in zip(samples_free, samples, strict=True):
            assert free.stop_reason == "length" and len(free.token_ids) == params.max_tokens
            if EOS in free.token_ids:
                # Same seed, same draws: the sample is the free one cut after its first eos.
                cut = free.token_ids.index(EOS) + 1
                assert sample.stop_reason == "stop"
                assert sample.token_ids == free.token_ids[:cut]
                assert sample.logprobs == pytest.approx(free.logprobs[:cut], abs=1e-5)
                stops += 1
            else:
                assert sample.stop_reason == "length"
                assert sample.token_ids == free.token_ids
    assert stops > 0, "the test needs at least one sample that draws eos: change the seed"


def test_stop_token_ids_stop_like_eos(engine):
    params = SamplingParams(n=2, max_tokens=10, seed=5)
    free = HFGenerateEngine(engine.model, eos_token_id=[]).generate(PROMPTS, params)[0][0]
    stop_token = free.token_ids[4]
    stop_params = params.model_copy(update={"stop_token_ids": [stop_token]})
    sample = HFGenerateEngine(engine.model, eos_token_id=[]).generate(PROMPTS, stop_params)[0][0]
    assert sample.stop_reason == "stop"
    assert sample.token_ids == free.token_ids[: free.token_ids.index(stop_token) + 1]


def test_same_seed_same_samples_other_seed_other_samples(engine):
    params = SamplingParams(n=2, max_tokens=8, seed=11)
    first = engine.generate(PROMPTS, params)
    assert engine.generate(PROMPTS, params) == first
    other = engine.generate(PROMPTS, params.model_copy(update={"seed": 12}))
    assert [s.token_ids for g in other for s in g] != [s.token_ids for g in first for s in g]


def test_greedy_and_filters_that_keep_one_token_pick_the_argmax(engine):
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6))
    top_k_1 = engine.generate(PROMPTS, SamplingParams(top_k=1, max_tokens=6, seed=0))
    top_p_tiny = engine.generate(PROMPTS, SamplingParams(top_p=1e-6, max_tokens=6, seed=0))
    for prompt, [g], [k], [p] in zip(PROMPTS, greedy, top_k_1, top_p_tiny, strict=True):
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([prompt + g.token_ids])).logits[0]
        assert g.token_ids == logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        assert g.logprobs == pytest.approx(
            reference_logprobs(engine, prompt, g.token_ids, 1.0).tolist(), abs=1e-4
        )
        assert k.token_ids == p.token_ids == g.token_ids
        # The filtered distribution keeps one token: it was sampled with probability 1.
        assert k.logprobs == pytest.approx([0.0] * len(k.token_ids), abs=1e-6)


def test_load_hf_state_dict_copies_in_place_and_changes_outputs():
    engine, other = make_engine(seed=0), make_engine(seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    before = engine.generate(PROMPTS, params)
    storage = {name: p.data_ptr() for name, p in engine.model.named_parameters()}
    # A model's own state dict includes the tied alias lm_head.weight: accepted.
    engine.load_hf_state_dict(other.model.state_dict())
    assert {name: p.data_ptr() for name, p in engine.model.named_parameters()} == storage
    after = engine.generate(PROMPTS, params)
    assert after != before
    assert after == other.generate(PROMPTS, params)


def test_template_round_trips_through_load(engine):
    template = engine.hf_state_dict_template()
    assert template.keys() == dict(engine.model.named_parameters()).keys()
    for name, p in engine.model.named_parameters():
        template[name].copy_(p)
        assert template[name].data_ptr() != p.data_ptr()
    before = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4))
    engine.load_hf_state_dict(template)
    assert engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4)) == before


def test_load_hf_state_dict_rejects_bad_state_dicts_without_touching_weights():
    engine = make_engine()
    good = {name: p.detach().clone() + 1.0 for name, p in engine.model.named_parameters()}
    snapshot = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    some_key = "model.layers.0.mlp.up_proj.weight"

    missing = dict(good)
    del missing[some_key]
    with pytest.raises(ValueError, match=f"missing keys.*{some_key}"):
        engine.load_hf_state_dict(missing)
    with pytest.raises(ValueError, match="unexpected keys.*model.layers.9.bogus"):
        engine.load_hf_state_dict({**good, "model.layers.9.bogus": torch.zeros(1)})
    with pytest.raises(ValueError, match=f"shape mismatches.*{some_key}"):
        engine.load_hf_state_dict({**good, some_key: torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="tied weights that differ.*lm_head.weight"):
        engine.load_hf_state_dict(
            {**good, "lm_head.weight": torch.zeros_like(good["model.embed_tokens.weight"])}
        )
    for name, p in engine.model.named_parameters():
        torch.testing.assert_close(p, snapshot[name], rtol=0, atol=0)


def test_untied_model_and_from_pretrained(tmp_path):
    engine = make_engine(tie_word_embeddings=False)
    assert "lm_head.weight" in engine.hf_state_dict_template()
    engine.model.save_pretrained(tmp_path)
    loaded = HFGenerateEngine.from_pretrained(tmp_path)
    params = SamplingParams(n=2, max_tokens=6, seed=2)
    assert loaded.generate(PROMPTS, params) == engine.generate(PROMPTS, params)


def test_rejects_empty_prompt(engine):
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([[1, 2], []], SamplingParams())


def test_a_seeded_sample_depends_on_its_key_and_index_not_on_its_batch(engine):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7)
    together = engine.generate(PROMPTS, params, sample_keys=[10, 11, 12])
    # The same (prompt, key) pairs drawn one call each, in another order, give the same samples.
    # (Tokens are equal; logprobs to float tolerance, since padding changes the batched sums.)
    alone = [engine.generate([PROMPTS[i]], params, sample_keys=[10 + i])[0] for i in (2, 0, 1)]
    for one, other in zip([alone[1], alone[2], alone[0]], together, strict=True):
        assert [s.token_ids for s in one] == [s.token_ids for s in other]
        for s, t in zip(one, other, strict=True):
            assert s.logprobs == pytest.approx(t.logprobs, abs=1e-5)
    # A prompt's samples differ from each other, and another key gives other samples.
    assert len({tuple(s.token_ids) for s in together[0]}) > 1
    moved = engine.generate(PROMPTS, params, sample_keys=[13, 11, 12])
    assert moved[0] != together[0] and moved[1:] == together[1:]
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate(PROMPTS, params, sample_keys=[1])


def test_seeded_draws_follow_the_distribution():
    """Inverse transform sampling over per-sample streams draws each token with its
    probability: frequencies of 4000 first tokens against the model's distribution."""
    engine = make_engine(seed=3)
    params = SamplingParams(n=4000, temperature=1.5, max_tokens=1, seed=0)
    [samples] = engine.generate([PROMPTS[1]], params)
    counts = torch.bincount(torch.tensor([s.token_ids[0] for s in samples]), minlength=32).double()
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([PROMPTS[1]])).logits[0, -1].double()
    probs = torch.softmax(logits / params.temperature, dim=-1)
    # Each count is within 5 binomial standard deviations of its expectation.
    sigma = (params.n * probs * (1 - probs)).sqrt()
    assert ((counts - params.n * probs).abs() <= 5 * sigma + 1).all()
    assert (counts[probs < 1e-6] == 0).all()
