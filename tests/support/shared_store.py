"""One real store for the tests of a module: its storage volume is a process of its own, which
takes seconds to start and stop, so a module starts it once. The tests run their coroutines on
the module's event loop (where the store's handles live), and the store is emptied after each
test: every test still starts from an empty store."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any

import torchstore as ts

from forge import store
from forge.controller import shutdown


class SharedStore:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """Runs `coroutine` to its end on the store's event loop."""
        return self.loop.run_until_complete(coroutine)

    async def empty(self) -> None:
        client = await ts.client(store._STORE_NAME)
        for key in await client.keys():
            await client.delete(key)
        assert await client.keys() == []


def shared_store() -> Iterator[SharedStore]:
    """The body of a module-scoped fixture: the started store, stopped (with every process the
    module started) at the module's end."""
    shared = SharedStore()
    try:
        shared.run(store.initialize())
        yield shared
    finally:
        try:
            shared.run(store.shutdown())
            shared.run(shutdown())
        finally:
            shared.loop.close()
