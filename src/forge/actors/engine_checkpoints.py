"""The run-checkpoint endpoints of an actor that trains an engine (the trainer, the critic): the
run's checkpointer (forge.runs) calls them on every rank, and each rank writes or reads its own
shard of the engine's model, optimizer, LR schedule and step (DCP)."""

from __future__ import annotations

from monarch.actor import endpoint

from forge.controller import ForgeActor


class EngineCheckpoints(ForgeActor):
    """A base for actors whose `setup` builds `self.engine` (a trainable `TitanEngine`)."""

    @endpoint
    async def save_to(self, directory: str) -> str:
        """Model, optimizer, LR schedule and step into `directory` (DCP; every rank writes)."""
        return str(self.engine.save_to(directory))

    @endpoint
    async def load_from(self, directory: str) -> int:
        """Restores what `save_to` wrote; returns the restored step."""
        self.engine.load_from(directory)
        return self.engine.step
