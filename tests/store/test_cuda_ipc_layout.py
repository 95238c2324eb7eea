"""The CPU-testable parts of the CUDA IPC weight path: the flat layout.

Opening another process's GPU memory needs CUDA: bench/weight_sync.py --verify runs that on a
2-GPU machine (bench/RESULTS.md has the result).
"""

import pytest
import torch

from forge.store.cuda_ipc import FlatLayout


def state_dict() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(7, 5, generator=generator),
        "norm.weight": torch.randn(3, generator=generator),
        "proj.weight": torch.randn(4, 9, generator=generator),
    }


def test_packing_into_the_layout_round_trips_with_the_cast():
    sd = state_dict()
    layout = FlatLayout.of(sd, torch.bfloat16)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    views = layout.views(buffer)
    for name, tensor in sd.items():
        views[name].copy_(tensor)
    for spec in layout.specs:
        assert spec.offset % 256 == 0 and spec.offset >= 256  # aligned, after the stamp
    unpacked = layout.views(buffer.clone())
    for name, tensor in sd.items():
        assert unpacked[name].dtype == torch.bfloat16
        assert torch.equal(unpacked[name], tensor.bfloat16())
    # Tensors do not overlap: rewriting one leaves the others.
    views["norm.weight"].fill_(0)
    assert torch.equal(layout.views(buffer)["embed.weight"], sd["embed.weight"].bfloat16())


def test_receiving_buffers_must_match_the_layout():
    sd = state_dict()
    layout = FlatLayout.of(sd, torch.bfloat16)
    layout.check_matches({n: t.bfloat16() for n, t in sd.items()})
    with pytest.raises(KeyError, match=r"missing from it \['proj.weight'\], not published \['other'\]"):
        layout.check_matches(
            {"embed.weight": sd["embed.weight"], "norm.weight": sd["norm.weight"], "other": sd["norm.weight"]}
        )
    with pytest.raises(
        ValueError,
        match=r"'norm.weight': published as \(3,\) torch.bfloat16, receiving buffer is \(3,\) torch.float32",
    ):
        layout.check_matches({n: t.bfloat16() if n != "norm.weight" else t for n, t in sd.items()})
