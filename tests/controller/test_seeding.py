"""A provisioner's seed reaches every process it starts: actors draw the same numbers run after run."""

import asyncio
import random

import pytest
import torch
from monarch.actor import endpoint

from forge.controller import ForgeActor, init_provisioner, shutdown
from forge.data.prompts import PromptCursor

pytestmark = pytest.mark.slow


class Dice(ForgeActor):
    @endpoint
    async def roll(self) -> tuple[list[float], float]:
        return torch.rand(3).tolist(), random.random()


async def _rolls(seed: int | None, meshes: int) -> list:
    await init_provisioner(seed=seed)
    try:
        return [await (await Dice.as_actor()).roll.route() for _ in range(meshes)]
    finally:
        await shutdown()


def test_seed_reaches_actor_processes_and_does_not_depend_on_spawn_order():
    first, again = asyncio.run(_rolls(5, 2))
    # The second mesh has another name (a spawn counter) and the same draws.
    assert first == again
    [other] = asyncio.run(_rolls(6, 1))
    assert other[0] != first[0] and other[1] != first[1]


def test_cursor_rows_carry_their_position_in_the_stream():
    rows = [{"prompt": str(i), "target": str(i)} for i in range(3)]
    cursor = PromptCursor(rows, seed=0)
    drawn = [cursor.next() for _ in range(7)]
    assert [r["index"] for r in drawn] == list(range(7))
    assert sorted(r["prompt"] for r in drawn[:3]) == ["0", "1", "2"]
    resumed = PromptCursor(rows, seed=0)
    resumed.load_state_dict(cursor.state_dict())
    assert resumed.next()["index"] == 7
