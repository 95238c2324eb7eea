"""A dead actor or an exception in an endpoint stops `wait_for_loops` with an error naming the actor."""

import asyncio
import os
import signal

import pytest
from monarch.actor import endpoint

from forge.controller import ForgeActor, shutdown
from forge.runs import RunStopped
from forge.runs.faults import wait_for_loops

pytestmark = pytest.mark.slow


class Fragile(ForgeActor):
    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def fail(self) -> None:
        raise ValueError("bad request")


async def _idle() -> None:
    await asyncio.sleep(3600)


def test_an_exception_in_an_endpoint_and_a_killed_process_name_the_actor():
    async def run():
        actor = await Fragile.as_actor()
        try:
            with pytest.raises(
                RunStopped, match=r"actor Fragile_\d+ raised in fail\(\): ValueError: bad request"
            ):
                await wait_for_loops(
                    asyncio.ensure_future(actor.fail.route()), [asyncio.create_task(_idle())]
                )

            pid = await actor.pid.route()
            main = asyncio.create_task(_idle())
            asyncio.get_running_loop().call_later(0.5, os.kill, pid, signal.SIGKILL)
            with pytest.raises(RunStopped, match=r"actor Fragile_\d+ died"):
                await asyncio.wait_for(wait_for_loops(main, []), 120)
        finally:
            await shutdown()

    asyncio.run(run())
