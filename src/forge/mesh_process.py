"""What runs in each process of a mesh the provisioner starts: first, Monarch's bootstrap hook
(`start` on this host, `forge.controller.hosts.set_rank_env` on a worker, which both call `enter`
and `seed_rngs`); then, when the process's ForgeActor is made (`actor_made`) and as it stops
(`prepare_exit`). Each such process ends with its mesh.

This module is outside `forge.controller` and imports nothing heavy, because the hook runs before
the process imports anything else: with garbage collection off from there until the actor is
made, the imports of torch and of the actor's modules take about a quarter less CPU (their
collections find nothing to free), and a run starts seven or more processes at once.
"""

from __future__ import annotations

import gc
import os
import random
import sys

# True in a mesh's process (set by `start`), never in the program's own.
_in_mesh = False
# The seed of torch's global RNG in this process, until the actor is made (`actor_made`).
_torch_seed: int | None = None


def start(world_size: int, master_port: int, gpus: list[str], seed: int | None, defer_gc: bool) -> None:
    """Monarch's bootstrap hook on this host: the process's distributed environment, its GPUs,
    its seeds."""
    enter(defer_gc)
    from monarch.actor import current_rank

    rank = current_rank().rank
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    # Set before anything touches CUDA: the mesh's own GPUs first, then the others.
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    seed_rngs(seed, rank)


def enter(defer_gc: bool) -> None:
    """First in a mesh's process. `defer_gc`: no garbage collection until a ForgeActor is made
    here (a mesh whose actors are no ForgeActors, such as the weight store's, collects from the
    start)."""
    global _in_mesh
    _in_mesh = True
    if defer_gc:
        gc.disable()


def seed_rngs(seed: int | None, rank: int) -> None:
    """A distinct, repeatable seed per rank (`seed`: the mesh's, `forge.controller.seeding`), so
    that what an actor draws repeats from run to run: Python's RNG now, torch's when the actor is
    made, so that a process whose actor needs no torch (the dataset's, the reward functions')
    never imports it, a second of CPU at start-up."""
    global _torch_seed
    if seed is not None:
        random.seed(seed + rank)
        _torch_seed = seed + rank


def actor_made() -> None:
    """A ForgeActor is being made: its modules are imported, garbage collection is on again, and
    torch's RNG is seeded where they imported torch (an actor that draws from torch imports it
    with its module, before it is made; nothing drew from it before)."""
    global _torch_seed
    gc.enable()
    if _torch_seed is not None and "torch" in sys.modules:
        sys.modules["torch"].manual_seed(_torch_seed)
        _torch_seed = None


def prepare_exit() -> None:
    """An actor stops, and in a mesh's process the process exits next: every object alive is
    frozen, so that the interpreter's last garbage collections skip them. A process that imported
    torch otherwise spends about 0.7 s of CPU in them (seven processes stopped together on 2 cores:
    2.4 s against 0.9 s). Exit handlers still run and files are still closed. In the program's own
    process, nothing."""
    if _in_mesh:
        gc.freeze()
