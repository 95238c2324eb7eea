"""A checkpoint with more vocabulary rows than its tokenizer has tokens (Qwen pads them): the
generator never samples an id the tokenizer cannot decode, on both engines, and the trainer
scores the distribution the generator samples from, so a GRPO step stays on-policy."""

from pathlib import Path

import pytest
import torch
from hf_checkpoints import ROWS, make_padded_checkpoint
from on_policy import assert_one_step_is_on_policy
from transformers import AutoTokenizer

from forge.engines.generation import SamplingParams
from forge.engines.hf_generate import HFGenerateEngine

PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11], [1, 12, 13], [1, 20, 21, 22]]
SAMPLING = SamplingParams(n=8, temperature=1.0, max_tokens=16, seed=0)


@pytest.fixture(scope="module")
def padded(tmp_path_factory) -> Path:
    path = make_padded_checkpoint(tmp_path_factory.mktemp("padded"))
    assert len(AutoTokenizer.from_pretrained(path)) < ROWS
    return path


def sampled_ids(samples) -> list[int]:
    return [token for group in samples for sample in group for token in sample.token_ids]


def test_the_native_engine_samples_only_ids_the_tokenizer_decodes(padded):
    tokenizer = AutoTokenizer.from_pretrained(padded)
    unmasked = HFGenerateEngine.from_pretrained(padded)
    assert sum(t >= len(tokenizer) for t in sampled_ids(unmasked.generate(PROMPTS, SAMPLING))) > 100

    engine = HFGenerateEngine(unmasked.model, tokenizer=tokenizer)
    samples = engine.generate(PROMPTS, SAMPLING)
    assert max(sampled_ids(samples)) < len(tokenizer)
    # The logprobs are those of the distribution sampled from: the softmax over the decodable rows.
    prompt, [sample, *_] = PROMPTS[0], samples[0]
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + sample.token_ids])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits[:, : len(tokenizer)], -1).gather(
        -1, torch.tensor(sample.token_ids)[:, None]
    )
    torch.testing.assert_close(torch.tensor(sample.logprobs), expected.squeeze(-1), rtol=0, atol=1e-5)


def test_a_grpo_step_on_a_padded_checkpoint_is_on_policy(padded, tmp_path):
    """The trainer scores the rows the generator samples: without that, its logprobs would be
    those of a softmax over all rows, far below the generator's here."""
    assert_one_step_is_on_policy(padded, tmp_path)
