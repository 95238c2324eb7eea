"""Compatibility between torchstore 0.1.2 and torchmonarch 0.7.0.

torchstore's `Controller` mixes sync and async endpoints, which monarch 0.7 refuses at
spawn time. This subclass re-declares the sync ones as async with the same bodies. It is
spawned under torchstore's controller name before `torchstore.initialize`, so every later
lookup by name (in this process or any other) finds it instead of spawning the original.
"""

from monarch.actor import endpoint
from torchstore.controller import Controller


class AsyncController(Controller):
    @endpoint
    async def get_controller_strategy(self):
        return Controller.get_controller_strategy._method(self)

    @endpoint
    async def locate_volumes(self, key: str):
        return Controller.locate_volumes._method(self, key)

    @endpoint
    async def notify_put(self, key: str, request, storage_volume_id: str) -> None:
        return Controller.notify_put._method(self, key, request, storage_volume_id)

    @endpoint
    async def keys(self, prefix=None):
        return Controller.keys._method(self, prefix)

    @endpoint
    async def notify_delete(self, key: str, storage_volume_id: str) -> None:
        return Controller.notify_delete._method(self, key, storage_volume_id)
