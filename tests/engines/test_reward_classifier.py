"""The classifier reward engine against transformers' own forward, one text at a time."""

import pytest
import torch
from reward_checkpoints import make_classifier
from transformers import AutoModelForSequenceClassification

from forge.engines.reward_classifier import ClassifierRewardEngine

PROMPTS = ["1+1=", "12+30=", "7+8=", "3+3=", "40+2="]
RESPONSES = ["2", "42<eos>", "15", "6", "9"]


def direct_scores(path, engine: ClassifierRewardEngine, num_labels: int) -> list[float]:
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    scores = []
    for prompt, response in zip(PROMPTS, RESPONSES, strict=True):
        ids = engine.tokenizer(engine.text(prompt, response), return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            logits = model(**ids).logits[0]
        scores.append(logits[0].item() if num_labels == 1 else logits.softmax(-1)[-1].item())
    return scores


@pytest.mark.parametrize("num_labels", [1, 3])
def test_scores_equal_a_direct_forward_in_batches_of_batch_size(tmp_path, num_labels):
    path = make_classifier(tmp_path, num_labels)
    engine = ClassifierRewardEngine(str(path), batch_size=2)
    # The embedded tokenizer's chat template wraps the pair; padding must not change a score.
    assert engine.text("1+1=", "2") == "<bos>1+1=2<eos>"
    widths = []
    forward = engine.model.forward
    engine.model.forward = lambda **kw: widths.append(kw["input_ids"].shape[0]) or forward(**kw)
    scores = engine.score(PROMPTS, RESPONSES)
    assert widths == [2, 2, 1]
    torch.testing.assert_close(scores, direct_scores(path, engine, num_labels), rtol=0, atol=1e-5)
    if num_labels > 1:
        assert all(0 < s < 1 for s in scores)
