"""TitanEngine checkpoints (`save_to` / `load_from`): exact resume and extra_state. Atomicity,
retention and verification are the run checkpoint's (tests/runs/test_checkpoint_safety.py)."""

import pytest
import torch
from titan_testing import LossOutput, lm_batch

from forge.engines.titan.config import TitanEngineConfig
from forge.engines.titan.engine import TitanEngine
from forge.rl.batch import PolicyBatch

VOCAB = 40


def next_token_ce(logits: torch.Tensor, batch: PolicyBatch) -> LossOutput:
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch.target_ids.flatten())
    return LossOutput(loss, {})


def batches(count: int, start: int = 0) -> list[PolicyBatch]:
    """Different data at every step, so that a resume from the wrong state shows."""
    return [
        lm_batch(torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(i)))
        for i in range(start, start + count)
    ]


def make_config(seed: int = 0) -> TitanEngineConfig:
    # A decaying LR with warmup: a resume that lost the scheduler state would change the losses.
    return TitanEngineConfig.model_validate(
        {
            "model": {"vocab_size": VOCAB},
            "training": {"seq_len": 32, "seed": seed},
            "lr_scheduler": {"warmup_steps": 2, "decay_type": "cosine", "total_steps": 10},
        }
    )


def train(engine: TitanEngine, data: list[PolicyBatch]) -> list[float]:
    return [engine.train_step(batch, next_token_ce)["train/loss"] for batch in data]


def test_resume_reproduces_training_and_extra_state(tmp_path):
    first = TitanEngine(make_config())
    train(first, batches(2))
    cursor = {"dataset": {"epoch": 1, "index": 8}, "rng": torch.arange(3)}
    assert first.save_to(tmp_path / "trainer", extra_state=cursor) == tmp_path / "trainer"
    expected = train(first, batches(2, start=2))

    # Another seed: the resumed engine starts from different weights unless load works.
    resumed = TitanEngine(make_config(seed=7))
    extra_state = resumed.load_from(tmp_path / "trainer")
    assert resumed.step == 2
    assert extra_state["dataset"] == {"epoch": 1, "index": 8}
    assert torch.equal(extra_state["rng"], torch.arange(3))
    assert train(resumed, batches(2, start=2)) == pytest.approx(expected, rel=1e-6, abs=0)


def test_checkpointing_needs_a_trainable_engine_and_a_complete_checkpoint(tmp_path):
    with pytest.raises(RuntimeError, match="trainable=False"):
        TitanEngine(make_config(), trainable=False).save_to(tmp_path / "trainer")
    (tmp_path / "partial").mkdir()
    with pytest.raises(FileNotFoundError, match="no complete DCP checkpoint"):
        TitanEngine(make_config()).load_from(tmp_path / "partial")
