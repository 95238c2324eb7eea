"""scripts/install.sh's choices, without installing anything: which vLLM build a machine gets
(scripts/vllm_build.py), and that every package of either vLLM set is pinned by the project's
lock, so a GPU machine installs from the project's own pins as a CPU machine does."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_vllm_build():
    spec = importlib.util.spec_from_file_location("vllm_build", ROOT / "scripts" / "vllm_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("torch_cuda", "vllm", "build"),
    [(None, "1", "cpu"), ("13.0", "1", "cuda"), (None, "0", "none"), ("13.0", "0", "none")],
)
def test_the_vllm_build_follows_the_torch_build_and_vllm_0_skips_it(torch_cuda, vllm, build):
    assert load_vllm_build().choose(torch_cuda, vllm) == build


def names(path: Path, unpinned_only: bool = False) -> set[str]:
    """The distribution names a requirements or lock file lists (normalized as pip does); with
    `unpinned_only`, those it does not pin to one version itself."""
    found = set()
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not (unpinned_only and "==" in line):
            name = re.match(r"[A-Za-z0-9._-]+", line).group(0)
            found.add(re.sub(r"[-_.]+", "-", name).lower())
    return found


@pytest.mark.parametrize("build", ["cpu", "cuda"])
def test_every_package_of_a_vllm_set_is_pinned_by_the_lock(build):
    listed = names(ROOT / "requirements" / f"vllm-{build}.txt", unpinned_only=True)
    unpinned = listed - names(ROOT / "requirements" / "lock.txt")
    assert not unpinned, (
        f"requirements/vllm-{build}.txt lists {sorted(unpinned)}, which lock.txt does not pin"
    )
