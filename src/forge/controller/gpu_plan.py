"""The placement planner: which of this host's GPUs each model actor gets, decided and checked
before any process starts, and printed at start-up.

Two modes (`provisioner.colocate`):
- colocated: the trainer's ranks on GPUs 0..P-1 and the generator's replicas beside them,
  replica i on GPUs g*tp .. (g+1)*tp-1 with g = i // k (tp: its vLLM tensor-parallel size, k:
  `generator.replicas_per_gpu`), so each GPU holds a trainer rank and k generator replicas,
  or their share of them with TP;
- disaggregated: the trainer on GPUs 0..P-1, the replicas on the GPUs after them (k to a
  GPU, as above), then the GPUs of reward models and a teacher that have their own.

The reference model takes the trainer's GPUs (it has the trainer's processes and sharding).
A plan that cannot work is refused naming the config keys: too few GPUs, a tensor-parallel
size the model's attention heads cannot be split by, or a GPU asked to hold more memory than
it has: what is known before start-up, the trainer's weights, gradients and optimizer state and
the slots it publishes versions from, vLLM's weights, KV cache and runtime (or the share it
reserves), and the buffers each replica receives versions in.

The provisioner (`forge.controller.provisioner`) hands out GPUs by this plan: a mesh launched
with a planned GPU group takes that group's least used slot (the replacement of a dead replica
takes the slot it left).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field

# GPU groups (`ForgeActor.options(gpu_group=...)`). The trainer's meshes (trainer, reference
# model) share its GPUs; the generator's each take GPUs of their own, a slot per replica.
TRAINER_GROUP = "trainer"
GENERATOR_GROUP = "generator"
SLOT_GROUPS = frozenset({GENERATOR_GROUP})


class PlacementError(ValueError):
    """A placement that cannot work on this machine, refused before any process starts."""


@dataclass(frozen=True)
class Machine:
    """The GPUs a run may use: how many, and each one's memory (None: unknown, not checked)."""

    gpus: int
    memory_gib: float | None = None

    @classmethod
    def detect(cls, visible: list[str]) -> Machine:
        """The `visible` GPUs (indices as CUDA_VISIBLE_DEVICES names them), their memory read with
        nvidia-smi: the controller must not start CUDA (vLLM then has to spawn its workers)."""
        if not visible or shutil.which("nvidia-smi") is None:
            return cls(len(visible))
        query = ["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"]
        try:
            lines = subprocess.run(query, capture_output=True, text=True, check=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return cls(len(visible))
        memory = {}
        for line in lines.splitlines():
            index, mib = (part.strip() for part in line.split(","))
            memory[index] = float(mib) / 1024
        sizes = [memory[g] for g in visible if g in memory]
        return cls(len(visible), min(sizes) if len(sizes) == len(visible) else None)


@dataclass(frozen=True)
class PlacementRequest:
    """What a run asks of the GPUs (built from its config, e.g. `forge.runs.placement`)."""

    trainer_procs: int
    generator_replicas: int
    colocate: bool
    generator_tp: int = 1
    # Replicas that share each generator GPU (generator.replicas_per_gpu).
    generator_replicas_per_gpu: int = 1
    # The share of a GPU vLLM reserves (generator.vllm.gpu_memory_utilization); 0: not vLLM.
    generator_share: float = 0.0
    # The trainer's weights, gradients and optimizer state (and the reference model's weights)
    # per trainer GPU, in GiB; None: unknown, not checked.
    trainer_gib: float | None = None
    # Per trainer GPU, in GiB: the slots it stages each published version in (its rows of the
    # weights in the generator's dtype, once per slot).
    trainer_buffers_gib: float = 0.0
    # Per GPU of one replica, in GiB, when vLLM's KV cache has a fixed size: its weights (its
    # share of them with TP), that KV cache and vLLM's runtime memory. None: vLLM takes its share
    # of the GPU (generator_share), which covers all of these.
    generator_gib: float | None = None
    # Per replica, in GiB, on its (first) GPU: the buffers it receives versions in, outside
    # vLLM's own memory (a copy of the weights, two with the broadcast transport).
    generator_buffers_gib: float = 0.0
    # The policy's attention heads and key/value heads, which vLLM's TP splits; None: unchecked.
    attention_heads: tuple[int, int] | None = None
    # Meshes with GPUs of their own, after the generators': what they are ("reward model judge",
    # "teacher") -> GPUs they take.
    own_gpus: dict[str, int] = field(default_factory=dict)
    # generator.weight_transport=broadcast: every trainer rank and every replica in NCCL groups.
    weight_broadcast: bool = False


@dataclass
class GpuPlan:
    """GPU indices (into the visible GPUs) per GPU group: one list per mesh of the group."""

    slots: dict[str, list[list[int]]]
    colocate: bool
    machine: Machine
    own_gpus: dict[str, list[int]] = field(default_factory=dict)

    def planned_gpus(self) -> set[int]:
        return {gpu for group in self.slots.values() for slot in group for gpu in slot}

    def describe(self, names: list[str] | None = None) -> str:
        """The plan as lines to print; `names`: the visible GPUs' own names (CUDA_VISIBLE_DEVICES)."""

        def gpus(indices: list[int]) -> str:
            return ",".join(names[i] if names else str(i) for i in indices)

        memory = f", {self.machine.memory_gib:.0f} GiB each" if self.machine.memory_gib else ""
        mode = "colocated" if self.colocate else "disaggregated"
        lines = [f"placement ({mode}, {self.machine.gpus} GPUs{memory}):"]
        for group, label in (
            (TRAINER_GROUP, "trainer (and reference model)"),
            (GENERATOR_GROUP, "generator"),
        ):
            for i, slot in enumerate(self.slots.get(group, [])):
                replica = f" replica {i}" if group == GENERATOR_GROUP else ""
                lines.append(f"  {label}{replica}: GPU {gpus(slot)}")
        for name, taken in self.own_gpus.items():
            lines.append(f"  {name}: GPU {gpus(taken)}")
        unused = sorted(
            set(range(self.machine.gpus))
            - self.planned_gpus()
            - {g for t in self.own_gpus.values() for g in t}
        )
        if unused:
            lines.append(f"  unused: GPU {gpus(unused)}")
        return "\n".join(lines)


def plan_gpus(request: PlacementRequest, machine: Machine) -> GpuPlan:
    """The plan for `request` on `machine`, or a PlacementError naming the keys to change."""
    r = request
    _check_tensor_parallel(r)
    if r.trainer_procs > machine.gpus:
        raise PlacementError(
            f"trainer.procs ({r.trainer_procs}) needs a GPU per rank, and this machine has {machine.gpus} "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): lower trainer.procs"
        )
    per_gpu = r.generator_replicas_per_gpu
    generator_gpus = -(-r.generator_replicas // per_gpu) * r.generator_tp
    replicas = f"generator.replicas ({r.generator_replicas}) x generator.vllm.tensor_parallel_size ({r.generator_tp})"
    if per_gpu > 1:
        replicas = f"{replicas} / generator.replicas_per_gpu ({per_gpu}), rounded up,"
    trainer = list(range(r.trainer_procs))
    if r.colocate:
        if generator_gpus > machine.gpus:
            raise PlacementError(
                f"provisioner.colocate=true gives each generator replica GPUs of its own beside the trainer: "
                f"{replicas} = {generator_gpus} GPUs, but this machine has {machine.gpus}: lower them"
            )
        first = 0
    else:
        needed = r.trainer_procs + generator_gpus + sum(r.own_gpus.values())
        if needed > machine.gpus:
            own = "".join(f" + {name} ({n})" for name, n in r.own_gpus.items())
            raise PlacementError(
                f"provisioner.colocate=false gives the trainer GPUs of its own: trainer.procs ({r.trainer_procs}) "
                f"+ {replicas}{own} = {needed} GPUs, but this machine has {machine.gpus}: lower them, or set "
                "provisioner.colocate=true"
            )
        first = r.trainer_procs
    generators = [
        list(range(first + i // per_gpu * r.generator_tp, first + (i // per_gpu + 1) * r.generator_tp))
        for i in range(r.generator_replicas)
    ]
    own_gpus = {}
    if not r.colocate:
        next_free = first + generator_gpus
        for name, count in r.own_gpus.items():
            own_gpus[name] = list(range(next_free, next_free + count))
            next_free += count
    plan = GpuPlan({TRAINER_GROUP: [trainer], GENERATOR_GROUP: generators}, r.colocate, machine, own_gpus)
    _check_memory(r, plan)
    if r.weight_broadcast:
        _check_broadcast(trainer, generators)
    return plan


def _check_broadcast(trainer: list[int], generators: list[list[int]]) -> None:
    """NCCL refuses two members of one group on one GPU, and each trainer rank's group holds
    the rank and every replica (each receiving on the first GPU of its slot)."""
    receivers = [slot[0] for slot in generators]
    shared = sorted((set(trainer) & set(receivers)) | {g for g in receivers if receivers.count(g) > 1})
    if shared:
        raise PlacementError(
            "generator.weight_transport=broadcast sends over NCCL groups of each trainer rank and every "
            f"generator replica, which need a GPU each, but GPU {shared} would hold two of them "
            "(provisioner.colocate=true, or generator.replicas_per_gpu > 1): on one host use "
            "weight_transport=auto (CUDA IPC), or set provisioner.colocate=false and replicas_per_gpu=1"
        )


def _check_tensor_parallel(r: PlacementRequest) -> None:
    if r.generator_tp == 1 or r.attention_heads is None:
        return
    heads, kv_heads = r.attention_heads
    # vLLM splits the query heads evenly, and the key/value heads too, or replicates them
    # when there are fewer than ranks.
    if heads % r.generator_tp or (kv_heads % r.generator_tp and r.generator_tp % kv_heads):
        raise PlacementError(
            f"generator.vllm.tensor_parallel_size ({r.generator_tp}) must divide the policy's "
            f"{heads} attention heads and divide or be a multiple of its {kv_heads} key/value heads: "
            "choose a size that does"
        )


def _check_memory(r: PlacementRequest, plan: GpuPlan) -> None:
    """What each GPU is known to hold: the trainer's state and publish slots, and each replica's
    vLLM memory and receive buffers. A floor: activations come on top."""
    memory = plan.machine.memory_gib
    if memory is None:
        return
    for gpu in range(plan.machine.gpus):
        here = [slot for slot in plan.slots[GENERATOR_GROUP] if gpu in slot]
        receiving = sum(slot[0] == gpu for slot in here)
        parts = []
        on_trainer = gpu in plan.slots[TRAINER_GROUP][0]
        if on_trainer:
            if r.trainer_gib:
                parts.append((r.trainer_gib, "the trainer's weights, gradients and optimizer state"))
            if r.trainer_buffers_gib:
                parts.append((r.trainer_buffers_gib, "the trainer's slots for publishing versions"))
        each = f" for each of {len(here)} replicas (generator.replicas_per_gpu)" if len(here) > 1 else ""
        if here and r.generator_gib is not None:
            what = f"vLLM's weights, KV cache (generator.vllm.kv_cache_memory_gib) and runtime{each}"
            parts.append((r.generator_gib * len(here), what))
        elif here and r.generator_share:
            what = f"vLLM's generator.vllm.gpu_memory_utilization {r.generator_share}{each}"
            parts.append((r.generator_share * memory * len(here), what))
        if receiving and r.generator_buffers_gib:
            what = "the generator's receive buffers for new versions (a copy of the weights a replica)"
            parts.append((r.generator_buffers_gib * receiving, what))
        if sum(gib for gib, _ in parts) <= memory:
            continue
        advice = ["raise trainer.procs (FSDP shards that state)"] if on_trainer else []
        if here:
            key = "kv_cache_memory_gib" if r.generator_gib is not None else "gpu_memory_utilization"
            advice.insert(0, f"lower generator.vllm.{key}")
            if len(here) > 1:
                advice.insert(1, "lower generator.replicas_per_gpu")
            if plan.colocate:
                advice.append("set provisioner.colocate=false")
        listed = " and ".join(f"{what} (~{gib:.1f} GiB)" for gib, what in parts)
        raise PlacementError(f"GPU {gpu} ({memory:.0f} GiB) cannot hold {listed}: {', or '.join(advice)}")
