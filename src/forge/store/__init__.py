"""Versioned weight store: the only module of forge that imports torchstore.

The trainer publishes each policy version as a set of tensors under
`<prefix>.v<version>.<param name>` and then, last, a manifest `<prefix>_manifest.v<version>`
listing every name, shape and dtype. (torchstore indexes keys in a trie split on ".", and
lists keys by whole segments; keeping manifests under their own first segment lets
`versions()` list them without listing every tensor.) A version exists for readers only once its manifest
exists, so a reader can never load half of version v and half of v-1; and a reader fills
preallocated tensors in place, checked against the manifest first.

    await store.initialize()                          # once, in the controller process
    await store.put_state_dict(7, hf_state_dict)      # trainer
    await store.get_state_dict(7, into=my_buffers)    # generator, any process
    await store.delete(6)
"""

from __future__ import annotations

import asyncio
import logging
import re

import torch

from forge.monarch_env import set_frame_limit

# Before torchstore's import, which reads it (see forge.monarch_env).
set_frame_limit()

import torchstore as ts  # noqa: E402
from monarch.actor import get_or_spawn_controller  # noqa: E402

from forge.controller.hosts import STORE_MESH_NAME  # noqa: E402
from forge.controller.provisioner import get_provisioner  # noqa: E402
from forge.store._compat import AsyncController  # noqa: E402

DEFAULT_PREFIX = "policy"
_STORE_NAME = ts.api.DEFAULT_TORCHSTORE_NAME
_CONCURRENCY = 16


class VersionNotFoundError(KeyError):
    """The version was never published, or was deleted (possibly while being read)."""

    def __str__(self) -> str:
        return str(self.args[0])


def version_key(version: int, prefix: str = DEFAULT_PREFIX) -> str:
    if version < 0:
        raise ValueError(f"policy versions are >= 0, got {version}")
    return f"{prefix}.v{version:010d}"


def _manifest_key(version: int, prefix: str) -> str:
    return version_key(version, f"{prefix}_manifest")


logger = logging.getLogger(__name__)


async def initialize() -> None:
    """Starts the store (its controller and one storage volume). Call once per program.

    The volume's process comes from the provisioner, so with several hosts it runs where
    `provisioner.placement` says: by default on the trainer's host, since the trainer writes
    every byte and each generator reads it once. `placement()` reports where it is.
    """
    provisioner = await get_provisioner()
    await get_or_spawn_controller(_STORE_NAME, AsyncController)
    # Our own mesh for the storage volume (torchstore would spawn one it never stops).
    volume_mesh = await provisioner.get_proc_mesh(name=STORE_MESH_NAME, collect_metrics=False)
    await ts.initialize(store_name=_STORE_NAME, mesh=volume_mesh)
    where = await placement()
    if where is not None:
        logger.info("weight store volume on host %s (%s)", where["hosts"], where["addresses"])


async def placement() -> dict | None:
    """Where the storage volume runs when it is on a worker host (its host index, address
    and process), else None."""
    provisioner = await get_provisioner()
    return next((p for p in provisioner.placement() if p["mesh"] == STORE_MESH_NAME), None)


async def shutdown() -> None:
    """Drops every stored version. The storage volume's process is one of the provisioner's
    meshes, and stops with the others (`forge.controller.provisioner.shutdown`, called next by
    every program): stopping it here would wait for its exit alone, a second a run."""
    await ts.shutdown(_STORE_NAME)


async def _bounded(coroutines) -> list:
    """Runs the per-tensor transfers concurrently: each costs two round trips to Monarch
    actors, and overlapping them hides that latency (at most _CONCURRENCY at a time)."""
    semaphore = asyncio.Semaphore(_CONCURRENCY)

    async def one(coroutine):
        async with semaphore:
            return await coroutine

    return await asyncio.gather(*(one(c) for c in coroutines))


async def put_state_dict(
    version: int, state_dict: dict[str, torch.Tensor], prefix: str = DEFAULT_PREFIX
) -> None:
    """Publishes `state_dict` as `version`: every tensor first, the manifest last."""
    base = version_key(version, prefix)
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state_dict['{name}'] is a {type(tensor).__name__}, not a tensor")
    tensors = {name: tensor.detach() for name, tensor in state_dict.items()}
    await _bounded(ts.put(f"{base}.{name}", t, store_name=_STORE_NAME) for name, t in tensors.items())
    manifest = {name: (tuple(t.shape), str(t.dtype)) for name, t in tensors.items()}
    await ts.put(_manifest_key(version, prefix), manifest, store_name=_STORE_NAME)


async def _manifest(version: int, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    try:
        return await ts.get(_manifest_key(version, prefix), store_name=_STORE_NAME)
    except KeyError:
        available = await versions(prefix)
        raise VersionNotFoundError(
            f"weight version {version} is not in the store (published under '{prefix}': {available})"
        ) from None


def _check_buffers(version: int, manifest: dict, into: dict[str, torch.Tensor]) -> None:
    missing = sorted(set(manifest) - set(into))
    unexpected = sorted(set(into) - set(manifest))
    if missing or unexpected:
        raise KeyError(
            f"weight version {version} does not match the receiving state dict: "
            f"missing from it {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"not in the store {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name, (shape, dtype) in manifest.items():
        buf = into[name]
        if tuple(buf.shape) != tuple(shape) or str(buf.dtype) != dtype:
            raise ValueError(
                f"weight version {version}, '{name}': stored as {tuple(shape)} {dtype}, "
                f"receiving buffer is {tuple(buf.shape)} {buf.dtype}"
            )


async def get_state_dict(
    version: int, into: dict[str, torch.Tensor] | None = None, prefix: str = DEFAULT_PREFIX
) -> dict[str, torch.Tensor]:
    """Reads `version`. With `into`, fills those tensors in place (names, shapes, dtypes must
    match the published ones exactly) and returns it; without, returns new tensors."""
    manifest = await _manifest(version, prefix)
    if into is not None:
        _check_buffers(version, manifest, into)
    base = version_key(version, prefix)

    async def fetch(name: str) -> None:
        try:
            if into is not None:
                await ts.get(f"{base}.{name}", inplace_tensor=into[name], store_name=_STORE_NAME)
            else:
                out[name] = await ts.get(f"{base}.{name}", store_name=_STORE_NAME)
        except KeyError:
            raise VersionNotFoundError(
                f"weight version {version} was deleted while it was being read"
            ) from None

    out = into if into is not None else {}
    await _bounded(fetch(name) for name in manifest)
    return out


async def delete(version: int, prefix: str = DEFAULT_PREFIX) -> None:
    """Removes `version`: the manifest first, so no new reader starts on it."""
    manifest = await _manifest(version, prefix)
    base = version_key(version, prefix)
    await ts.delete(_manifest_key(version, prefix), store_name=_STORE_NAME)
    await _bounded(ts.delete(f"{base}.{name}", store_name=_STORE_NAME) for name in manifest)


async def put_object(version: int, obj: object, prefix: str) -> None:
    """Publishes one small picklable object as `version` under `prefix` (e.g. the handle of a
    version whose tensors travel another way); `versions(prefix)` lists it."""
    await ts.put(_manifest_key(version, prefix), obj, store_name=_STORE_NAME)


async def get_object(version: int, prefix: str) -> object:
    return await _manifest(version, prefix)


async def delete_object(version: int, prefix: str) -> None:
    await ts.delete(_manifest_key(version, prefix), store_name=_STORE_NAME)


_VERSION_RE = re.compile(r"\.v(\d+)$")


async def versions(prefix: str = DEFAULT_PREFIX) -> list[int]:
    """Complete (readable) versions under `prefix`, oldest first."""
    client = await ts.client(_STORE_NAME)
    keys = await client.keys(f"{prefix}_manifest")
    return sorted(int(m.group(1)) for k in keys if (m := _VERSION_RE.search(k)))


async def latest_version(prefix: str = DEFAULT_PREFIX) -> int | None:
    published = await versions(prefix)
    return published[-1] if published else None
