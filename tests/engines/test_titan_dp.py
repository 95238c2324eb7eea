"""FSDP2 with data_parallel_shard_degree=2 on CPU (gloo) matches a single-process run, and its
sharded checkpoints resume exactly; packed micro-batches too, when the ranks pack their shares
into different numbers of micro-batches. With LoRA too, its frozen weights kept in bfloat16
beside float32 adapters (bfloat16 compute), merged row by row on each rank for export.

The ranks are this file run as a script (``python test_titan_dp.py RANK ...``) rather than
``torch.multiprocessing`` functions: pytest imports test files under names (importlib mode)
that a spawned child could not import back.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from titan_testing import lm_batch, masked_ce

from forge.engines.lora_sync import AdapterSync, MergeOnArrival
from forge.engines.titan.config import TitanEngineConfig
from forge.engines.titan.engine import TitanEngine
from forge.rl.batch import PolicyBatch
from forge.rl.losses import build_loss

pytestmark = pytest.mark.slow

VOCAB = 40
WORLD_SIZE = 2
STEPS = 3


def global_batch(step: int) -> PolicyBatch:
    """Row r has 5 + r loss tokens: rank 0's share has fewer than rank 1's, so a mean of the
    ranks' means would differ from the step's token mean."""
    tokens = torch.randint(0, VOCAB, (8, 17), generator=torch.Generator().manual_seed(step))
    loss_mask = torch.zeros_like(tokens, dtype=torch.bool)
    for row in range(8):
        loss_mask[row, 4 : 10 + row] = True
    return lm_batch(tokens, loss_mask)


# rank 4 of 64 rows: FSDP shards A by its rows too.
LORA = {"rank": 4, "alpha": 8.0}


def make_config(hf_path: str | None, shard_degree: int, lora: bool = False) -> TitanEngineConfig:
    return TitanEngineConfig.model_validate(
        {
            "model": {"vocab_size": VOCAB, "hf_path": hf_path},
            # Packed by 24 tokens, rank 0's rows (9-12 tokens) make 2 micro-batches and rank 1's
            # (13-16) make 4: rank 0 runs two idle passes to match rank 1's collectives.
            "training": {
                "seq_len": 32,
                "microbatch_tokens": 24,
                "mixed_precision_param": "bfloat16" if lora else "float32",
            },
            "parallelism": {"data_parallel_shard_degree": shard_degree},
            "lora": LORA if lora else None,
        }
    )


def run_rank(rank: int, init_dir: str, out_dir: str, lora: bool) -> None:
    """One data-parallel rank: train on its half of each global batch, record, export, and
    check that a sharded checkpoint resumes the next step exactly."""
    engine = TitanEngine(make_config(init_dir, WORLD_SIZE, lora))
    assert engine.parallel_dims.fsdp_enabled and (engine.dp_rank, engine.dp_size) == (rank, WORLD_SIZE)
    if lora:
        base = {name: t.full_tensor() for name, t in engine.model.state_dict().items() if "lora_" not in name}
        assert {t.dtype for t in base.values()} == {torch.bfloat16}
    metrics = []
    for step in range(STEPS + 1):
        batch = global_batch(step).split(4)[rank]
        if step == STEPS:
            engine.export_hf(Path(out_dir) / "final")  # gathers the shards on every rank
            # Cast on the shards, then gathered: the same values as casting the gathered tensors.
            full, cast = engine.hf_state_dict(), engine.hf_state_dict(torch.bfloat16)
            assert cast.keys() == full.keys()
            for name, tensor in full.items():
                assert cast[name].dtype == torch.bfloat16 and torch.equal(cast[name], tensor.bfloat16()), name
            if lora:  # each rank merged its own rows: the merge of the whole tensors
                whole = {name: t.full_tensor() for name, t in engine.model.state_dict().items()}
                for module, hf_module in engine.adapters.hf_modules.items():
                    merged = whole[f"{module}.weight"].float() + 2.0 * (
                        whole[f"{module}.lora_B"] @ whole[f"{module}.lora_A"]
                    )
                    torch.testing.assert_close(full[f"{hf_module}.weight"], merged, rtol=0, atol=1e-6)
                # What the ranks publish (the adapters, gathered whole), merged by a generator onto
                # the checkpoint's base (bfloat16, as the trainer keeps it): the same weights.
                adapters = engine.hf_adapter_state_dict()
                sync = AdapterSync.of(engine.config, "merge")
                shapes = {name: t.shape for name, t in full.items()}
                merge = MergeOnArrival.from_checkpoint(sync, init_dir, shapes, torch.float32)
                compared = 0
                for chunk in merge.chunks(adapters):  # compared before the next chunk reuses the buffer
                    for name, tensor in chunk.items():
                        torch.testing.assert_close(tensor, full[name], rtol=0, atol=1e-6)
                        compared += 1
                assert compared == len(engine.adapters.hf_modules)
            engine.save_to(Path(out_dir) / "trainer", extra_state={"cursor": step})
            after_save = engine.train_step(batch, masked_ce)["train/loss"]
            assert engine.load_from(Path(out_dir) / "trainer") == {"cursor": step} and engine.step == step
        metrics.append(engine.train_step(batch, masked_ce))
    assert metrics[-1]["train/loss"] == after_save
    if lora:  # the frozen base is bit for bit the checkpoint's, in bfloat16
        for name, tensor in engine.model.state_dict().items():
            assert "lora_" in name or torch.equal(tensor.full_tensor(), base[name]), name
    packed = engine.train_step(global_batch(STEPS + 1).split(4)[rank], build_loss("sft"))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps([*metrics[:STEPS], packed]))
    dist.destroy_process_group()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fsdp_two_ranks_match_one_process(tmp_path, lora):
    init_dir = str(tmp_path / "init")
    TitanEngine(make_config(None, 1)).export_hf(init_dir)

    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), init_dir, str(tmp_path), str(int(lora))],
            env={
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(WORLD_SIZE),
                "OMP_NUM_THREADS": "1",
                # This file runs as a script there: give it the shared test helpers.
                "PYTHONPATH": os.pathsep.join(
                    [str(Path(__file__).parents[1] / "support"), os.environ.get("PYTHONPATH", "")]
                ),
            },
        )
        for rank in range(WORLD_SIZE)
    ]
    try:
        codes = [proc.wait(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert codes == [0] * WORLD_SIZE

    # The same global batches, in one process, whole: the step's token mean and its max. Within
    # float32's rounding, or bfloat16 compute's (LoRA's run: each rank computes half the batch).
    rel = 1e-3 if lora else 1e-5
    single = TitanEngine(make_config(init_dir, 1, lora))
    expected = [single.train_step(global_batch(step), masked_ce) for step in range(STEPS)]
    trained_state = {k: v.clone() for k, v in single.model.state_dict().items()}
    single.train_step(global_batch(STEPS), masked_ce)
    expected_packed = single.train_step(global_batch(STEPS + 1), build_loss("sft"))
    for rank in range(WORLD_SIZE):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for step in range(STEPS):
            for key in ("train/loss", "loss/nll", "loss/nll_max", "train/grad_norm"):
                assert got[step][key] == pytest.approx(expected[step][key], rel=rel), (rank, step, key)
            assert got[step]["train/tokens"] == expected[step]["train/tokens"]
        for key in ("train/loss", "sft/loss", "sft/token_accuracy", "train/grad_norm"):
            assert got[STEPS][key] == pytest.approx(expected_packed[key], rel=rel), (rank, key)
    single.model.load_state_dict(trained_state)

    if not lora:  # (LoRA's merged weights: checked by the ranks, which merge them row by row)
        trained = TitanEngine(make_config(str(tmp_path / "final"), 1), trainable=False)
        tokens = global_batch(0).tokens
        torch.testing.assert_close(trained.forward(tokens), single.forward(tokens), rtol=0, atol=1e-5)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    run_rank(int(sys.argv[1]), sys.argv[2], sys.argv[3], bool(int(sys.argv[4])))
