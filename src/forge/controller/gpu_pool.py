"""One host's GPUs and who holds them: the one allocator, for this host and for each worker
host (`forge.controller.hosts`), with the same rules everywhere. A mesh asking for `procs`
GPUs with a GPU group gets, in this order:

1. its group's least used slot, when the run's placement plan has the group
   (`forge.controller.gpu_plan`: the trainer's GPUs, one slot per generator replica);
2. with `colocate`, the host's first GPUs;
3. the GPUs of its group's first live mesh that spans the same hosts (`span`; a sharing
   group: the reference model on the trainer's GPUs); the generator's group is never shared
   this way (its replicas each take GPUs of their own);
4. GPUs no one holds.

A GPU is free again once no mesh holds it; a group's GPUs go with its last mesh.
"""

from __future__ import annotations

from collections import Counter

from forge.controller.gpu_plan import SLOT_GROUPS, GpuPlan


class GpuPool:
    def __init__(self, gpus: list[str], plan: GpuPlan | None = None, colocate: bool = False, where: str = ""):
        self.gpus = list(gpus)
        self.plan = plan
        self.colocate = colocate
        self.where = where  # for messages: " on host 1 (tls://...)", or "" for this host
        self._planned = {self.gpus[i] for i in plan.planned_gpus()} if plan else set()
        self.free = [g for g in self.gpus if g not in self._planned]
        self._holders: Counter[str] = Counter()
        self._groups: dict[tuple[str, tuple[int, ...]], list[str]] = {}
        self._slot_use: dict[str, Counter[int]] = {}

    def take(self, procs: int, name: str, group: str | None = None, span: tuple[int, ...] = ()) -> list[str]:
        """`procs` GPUs for mesh `name` of `group` spanning hosts `span` (none when this host
        has none), by the rules above."""
        if not self.gpus:
            return []
        if self.plan is not None and self.plan.slots.get(group or ""):
            taken = self._least_used_slot(procs, name, group)
        elif self.colocate:
            if procs > len(self.gpus):
                raise RuntimeError(f"mesh '{name}' needs {procs} GPU(s); {self._host} has {len(self.gpus)}")
            taken = self.gpus[:procs]
        elif (group, span) in self._groups and group not in SLOT_GROUPS:
            shared = self._groups[(group, span)]
            if procs > len(shared):
                raise RuntimeError(
                    f"mesh '{name}' needs {procs} GPU(s){self.where} but its GPU group '{group}' has "
                    f"{len(shared)} there ({','.join(shared)}): lower its procs or leave the group"
                )
            taken = shared[:procs]
        else:
            taken = self._take_free(procs, name)
            if group is not None and group not in SLOT_GROUPS:
                self._groups[(group, span)] = taken
        self._holders.update(taken)
        return taken

    def give_back(self, gpus: list[str], group: str | None = None) -> None:
        """What `take` gave a mesh of `group` that stopped."""
        if not gpus:
            return
        use = self._slot_use.get(group or "")
        if use is not None:
            index = next(i for i, slot in enumerate(self._slots(group)) if slot == gpus and use[i] > 0)
            use[index] -= 1
        for gpu in gpus:
            self._holders[gpu] -= 1
            if self._holders[gpu] <= 0:
                del self._holders[gpu]
                if gpu in self.free or gpu in self._planned:
                    continue
                self.free.append(gpu)
        self._groups = {
            g: held for g, held in self._groups.items() if any(gpu in self._holders for gpu in held)
        }

    @property
    def _host(self) -> str:
        return f"host{self.where}" if self.where else "this program"

    def _slots(self, group: str) -> list[list[str]]:
        return [[self.gpus[i] for i in slot] for slot in self.plan.slots[group]]

    def _least_used_slot(self, procs: int, name: str, group: str) -> list[str]:
        """Replica i gets slot i, and a dead replica's replacement the slot it left."""
        slots = self._slots(group)
        use = self._slot_use.setdefault(group, Counter())
        index = min(range(len(slots)), key=lambda i: (use[i], i))
        if procs > len(slots[index]):
            raise RuntimeError(
                f"mesh '{name}' needs {procs} GPU(s) but the placement plan gives its group '{group}' "
                f"{len(slots[index])} ({','.join(slots[index])})"
            )
        use[index] += 1
        return slots[index]

    def _take_free(self, procs: int, name: str) -> list[str]:
        if not self.free:
            raise RuntimeError(f"mesh '{name}' needs {procs} GPU(s) but all GPUs{self.where} are taken")
        if len(self.free) < procs:
            raise RuntimeError(
                f"mesh '{name}' needs {procs} GPU(s){self.where} but only {len(self.free)} are free there "
                f"({','.join(self.free)}): lower its procs or free GPUs"
            )
        taken, self.free = self.free[:procs], self.free[procs:]
        return taken
