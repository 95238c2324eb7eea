"""TitanEngine checkpoints: exact resume, extra_state, atomicity, retention."""

import pytest
import torch
import torch.distributed as dist
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


def make_config(folder, seed: int = 0) -> TitanEngineConfig:
    # A decaying LR with warmup: a resume that lost the scheduler state would change the losses.
    return TitanEngineConfig.model_validate(
        {
            "model": {"vocab_size": VOCAB},
            "training": {"seq_len": 32, "seed": seed},
            "lr_scheduler": {"warmup_steps": 2, "decay_type": "cosine", "total_steps": 10},
            "checkpoint": {"folder": None if folder is None else str(folder), "keep_latest_k": 2},
        }
    )


@pytest.fixture(scope="module", autouse=True)
def _own_process_group():
    """The first engine creates a world-size-1 process group; drop it for the next modules."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def train(engine: TitanEngine, data: list[PolicyBatch]) -> list[float]:
    return [engine.train_step(batch, next_token_ce)["train/loss"] for batch in data]


def test_resume_reproduces_training_and_extra_state(tmp_path):
    first = TitanEngine(make_config(tmp_path))
    assert first.latest_step() is None
    train(first, batches(2))
    cursor = {"dataset": {"epoch": 1, "index": 8}, "rng": torch.arange(3)}
    path = first.save(extra_state=cursor)
    assert path == tmp_path / "step-2"
    expected = train(first, batches(2, start=2))

    # Another seed: the resumed engine starts from different weights unless load works.
    resumed = TitanEngine(make_config(tmp_path, seed=7))
    extra_state = resumed.load()
    assert resumed.step == 2
    assert extra_state["dataset"] == {"epoch": 1, "index": 8}
    assert torch.equal(extra_state["rng"], torch.arange(3))
    assert train(resumed, batches(2, start=2)) == pytest.approx(expected, rel=1e-6, abs=0)


def test_half_written_checkpoints_are_ignored_and_old_ones_purged(tmp_path):
    engine = TitanEngine(make_config(tmp_path))
    train(engine, batches(1))
    engine.save(extra_state={"at": 1})
    # What a crash leaves: a tmp dir (even one with DCP metadata) and a dir without metadata.
    (tmp_path / "step-9.tmp").mkdir()
    (tmp_path / "step-9.tmp" / ".metadata").write_bytes(b"partial")
    (tmp_path / "step-8").mkdir()
    assert engine.latest_step() == 1

    other = TitanEngine(make_config(tmp_path))
    assert other.load() == {"at": 1} and other.step == 1
    with pytest.raises(FileNotFoundError, match=r"step 8 .*complete steps: \[1\]"):
        other.load(step=8)

    train(engine, batches(1, start=1))
    engine.save()  # also clears the tmp leftovers
    assert not (tmp_path / "step-9.tmp").exists()
    train(engine, batches(1, start=2))
    engine.save()
    assert engine.latest_step() == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-3", "step-8"]
    assert other.load(step=2) == {} and other.step == 2


def test_checkpointing_needs_a_folder_and_a_trainable_engine(tmp_path):
    with pytest.raises(ValueError, match="checkpoint.folder"):
        TitanEngine(make_config(None)).save()
    with pytest.raises(RuntimeError, match="trainable=False"):
        TitanEngine(make_config(tmp_path), trainable=False).save()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        TitanEngine(make_config(tmp_path / "empty")).load()
