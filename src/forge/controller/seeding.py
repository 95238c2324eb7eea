"""Seeds for the processes the provisioner starts: each process seeds Python's and torch's
global RNGs with (run seed, its mesh's name, its rank) before any actor starts (torch's as the
actor is made: `forge.mesh_process.seed_rngs`), so that what an actor draws from them repeats
from run to run."""

from __future__ import annotations


def mesh_seed(seed: int, mesh_name: str) -> int:
    """Mesh names end in a spawn counter (`Generator_3`); the seed must not depend on it, so
    that a run seeds an actor the same however many meshes were started before it."""
    from forge.engines.generation import sample_seed

    base = mesh_name.rstrip("0123456789").rstrip("_")
    return sample_seed(seed, int.from_bytes(base.encode()[:8], "little")) % 2**32
