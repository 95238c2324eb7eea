"""The copies a weight loader makes, recorded once and replayed as one batched copy.

A model's own loader (vLLM's ``load_weights``) walks every checkpoint tensor in Python: it
maps names, narrows fused parameters (q, k and v into one ``qkv_proj``) and copies. That is
hundreds of small copies and a few ms of Python on an idle GPU, but far more on a GPU that a
trainer shares, where every operation waits its turn. The loader's work does not depend on the
values, only on names and shapes, so it is recorded once: ``record`` runs the loader under a
dispatch mode that sees every tensor operation and keeps, for each copy into a target tensor,
which region of which input it reads. ``CopyPlan.replay`` then does the same copies with
``torch._foreach_copy_`` (a few kernels) and no Python per tensor.

A loader that does anything a replay could not repeat is refused with the reason
(``PlanRejected``): writing a target from something that is not an input (a transposed or
converted temporary), writing a target by another operation than a copy or a constant fill,
changing an input, or writing one region twice. Whoever uses a plan should still compare one
replay with the loader on new values (``ReplayedLoader`` does, by exact fingerprints) because a
loader could, in principle, write a target by replacing it rather than by writing into it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from forge.fingerprint import fingerprint

logger = logging.getLogger(__name__)


class PlanRejected(RuntimeError):
    """The loader did something a replay of its copies would not repeat."""


@dataclass(frozen=True)
class _Region:
    """A strided view of a named tensor's storage: `offset` is relative to the tensor's own."""

    name: str
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.as_strided(self.size, self.stride, tensor.storage_offset() + self.offset)

    def span(self) -> tuple[int, int]:
        """The elements it may touch, [start, end) relative to its tensor (empty when a size is 0)."""
        if 0 in self.size:
            return self.offset, self.offset
        last = sum((n - 1) * s for n, s in zip(self.size, self.stride, strict=True))
        return self.offset, self.offset + last + 1


@dataclass(frozen=True)
class _Copy:
    target: _Region
    source: _Region


@dataclass(frozen=True)
class _Fill:
    target: _Region
    value: float | int | bool


class _Named:
    """Finds which named tensor a view belongs to: same storage, and within its elements."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._by_storage: dict[int, list[tuple[int, int, str, torch.Tensor]]] = {}
        for name, tensor in tensors.items():
            start = tensor.storage_offset()
            entry = (start, start + tensor.numel(), name, tensor)
            self._by_storage.setdefault(_storage_key(tensor), []).append(entry)

    def aliases(self, view: torch.Tensor) -> bool:
        return _storage_key(view) in self._by_storage

    def region(self, view: torch.Tensor) -> _Region | None:
        for start, end, name, tensor in self._by_storage.get(_storage_key(view), []):
            if view.dtype != tensor.dtype:
                continue
            region = _Region(name, view.storage_offset() - start, tuple(view.shape), tuple(view.stride()))
            low, high = region.span()
            if 0 <= low and start + high <= end:
                return region
        return None


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an operation writes, from its schema."""
    written = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        written += [v for v in values if isinstance(v, torch.Tensor)]
    return written


class _Recorder(TorchDispatchMode):
    def __init__(self, targets: _Named, inputs: _Named):
        super().__init__()
        self.targets, self.inputs = targets, inputs
        self.copies: list[_Copy] = []
        self.fills: list[_Fill] = []
        self.rejected: str | None = None

    def _reject(self, reason: str) -> None:
        self.rejected = self.rejected or reason

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for tensor in _written(func, args, kwargs):
            if self.inputs.aliases(tensor):
                self._reject(f"the loader changes an input in place ({func})")
            elif self.targets.aliases(tensor):
                self._note(func, tensor, args)
        return func(*args, **kwargs)

    def _note(self, func, written: torch.Tensor, args: tuple) -> None:
        target = self.targets.region(written)
        if target is None:
            self._reject(f"{func} writes a target through a view of another dtype or extent")
        elif func is torch.ops.aten.copy_.default:
            source = self.inputs.region(args[1])
            if source is None or args[1].dtype != written.dtype or args[1].shape != written.shape:
                self._reject(f"'{target.name}' is copied from something that is not an input as it is")
            else:
                self.copies.append(_Copy(target, source))
        elif func is torch.ops.aten.fill_.Scalar:
            self.fills.append(_Fill(target, args[1]))
        elif func is torch.ops.aten.zero_.default:
            self.fills.append(_Fill(target, 0))
        else:
            self._reject(f"'{target.name}' is written by {func}, not by a copy")


@dataclass(frozen=True)
class CopyPlan:
    copies: tuple[_Copy, ...]
    fills: tuple[_Fill, ...]
    # What the inputs must be for a replay: name -> (shape, dtype).
    inputs: dict[str, tuple[tuple[int, ...], torch.dtype]]

    def replay(self, targets: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> None:
        """The recorded copies, from `inputs` (the recorded names, shapes and dtypes) into `targets`."""
        for name, (shape, dtype) in self.inputs.items():
            tensor = inputs.get(name)
            if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != dtype:
                found = None if tensor is None else (tuple(tensor.shape), tensor.dtype)
                raise ValueError(f"input '{name}': recorded as {(shape, dtype)}, given {found}")
        with torch.no_grad():
            torch._foreach_copy_(
                [c.target.of(targets[c.target.name]) for c in self.copies],
                [c.source.of(inputs[c.source.name]) for c in self.copies],
            )
            for fill in self.fills:
                fill.target.of(targets[fill.target.name]).fill_(fill.value)


def record(
    load: Callable[[], object], targets: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]
) -> CopyPlan:
    """Runs `load` (which reads `inputs` and writes `targets`) and returns the copies it made.

    The load happens either way; raises `PlanRejected` after it when it cannot be replayed."""
    recorder = _Recorder(_Named(targets), _Named(inputs))
    with torch.no_grad(), recorder:
        load()
    if recorder.rejected is None:
        _check_disjoint([c.target for c in recorder.copies] + [f.target for f in recorder.fills], recorder)
    if recorder.rejected is None and not recorder.copies:
        recorder.rejected = "the loader copied nothing from the inputs"
    if recorder.rejected is not None:
        raise PlanRejected(recorder.rejected)
    used = {c.source.name for c in recorder.copies}
    shapes = {name: (tuple(inputs[name].shape), inputs[name].dtype) for name in sorted(used)}
    return CopyPlan(tuple(recorder.copies), tuple(recorder.fills), shapes)


def _check_disjoint(regions: list[_Region], recorder: _Recorder) -> None:
    """Replayed together, the copies must not overlap: the loader's order would be lost."""
    spans = sorted((r.name, *r.span()) for r in regions if r.span()[0] != r.span()[1])
    for (name, _, end), (next_name, start, _) in zip(spans, spans[1:], strict=False):
        if name == next_name and start < end:
            recorder.rejected = f"'{name}' is written twice (overlapping regions)"
            return


class ReplayedLoader:
    """Loads weights with `load` (a model's loader) while recording it, then by replaying it.

    `targets()` gives the tensors the loader writes (a model's parameters, looked up again at
    each load). The second load replays and then runs `load` too, and the plan is used from
    then on only if the loader left every target as the replay had made it (an exact check on
    values the plan was not recorded with). A rejected or disagreeing plan is dropped, with a
    warning, and `load` is used from then on."""

    def __init__(
        self,
        load: Callable[[list[tuple[str, torch.Tensor]]], object],
        targets: Callable[[], dict[str, torch.Tensor]],
        what: str,
    ):
        self._load, self._targets, self.what = load, targets, what
        self.plan: CopyPlan | None = None
        self.checked = False
        self.given_up = False

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        inputs = dict(weights)
        if self.given_up or len(inputs) != len(weights):  # a name twice: the loader's order matters
            self._load(weights)
        elif self.plan is None:
            try:
                self.plan = record(lambda: self._load(weights), self._targets(), inputs)
            except PlanRejected as e:
                self._give_up(f"its copies cannot be replayed: {e}")
        elif not self.checked:
            self._check(weights, inputs)
        else:
            self.plan.replay(self._targets(), inputs)

    def _check(self, weights: list[tuple[str, torch.Tensor]], inputs: dict[str, torch.Tensor]) -> None:
        """Replays, then runs the loader on the same values: the fingerprints of every target
        (computed where it lives, one wait in all) must not change."""
        targets = self._targets()
        self.plan.replay(targets, inputs)
        replayed = _fingerprints(targets)
        self._load(weights)
        targets = self._targets()  # looked up again: the loader may have replaced a parameter
        same = (replayed == _fingerprints(targets)).tolist()
        differ = [name for name, equal in zip(targets, same, strict=True) if not equal]
        if differ:
            self._give_up(f"a replay left {differ[:3]} other than the loader does")
        else:
            self.checked = True

    def _give_up(self, reason: str) -> None:
        logger.warning("%s: loading through the model's loader from now on: %s", self.what, reason)
        self.plan, self.given_up = None, True


def _fingerprints(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """One exact fingerprint per tensor (a model's parameters: one device)."""
    return torch.stack([fingerprint(t) for t in tensors.values()])
