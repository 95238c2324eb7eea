"""Actors that hang while alive (their process stopped by SIGSTOP: it exists, answers nothing):
a service replica that misses a call's deadline or an idle replica's probe is killed and
replaced, and the call retried elsewhere; a lone actor that misses one is killed and named."""

import asyncio
import os
import signal

import psutil
import pytest
from monarch.actor import endpoint

from forge.controller import ForgeActor, ProvisionerConfig, init_provisioner, shutdown
from forge.controller.liveness import ActorHungError, Probe

pytestmark = pytest.mark.slow


class Worker(ForgeActor):
    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def double(self, n: int) -> int:
        return 2 * n


def stopped(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.1)


def test_a_replica_that_misses_a_deadline_is_killed_replaced_and_its_call_retried():
    async def main():
        await init_provisioner(ProvisionerConfig())
        service = await Worker.options(num_replicas=2).as_service()
        try:
            first, second = await service.pid.fanout()
            stopped(first)
            # Round robin reaches the stopped replica within two calls; each call is answered.
            answers = [await service.double.route_within(3.0, n) for n in range(4)]
            assert answers == [0, 2, 4, 6]
            await wait_until(lambda: service.replacements == 1, 30, "the replacement")
            await wait_until(lambda: gone(first), 10, "the hung process to be killed")
            assert not gone(second)
            assert second in await service.pid.fanout()  # the healthy replica stays
            assert await service.double.route_within(3.0, 5) == 10
        finally:
            await shutdown()

    asyncio.run(main())


def test_an_idle_replica_that_stops_answering_is_found_by_the_probe():
    async def main():
        await init_provisioner(ProvisionerConfig())
        service = await Worker.options(num_replicas=2).as_service(probe=Probe(every_s=0.3, timeout_s=1.0))
        try:
            first, _ = await service.pid.fanout()
            stopped(first)  # no call is made: only the probe can find it
            await wait_until(lambda: service.replacements == 1, 30, "the probe to replace the replica")
            assert gone(first)
            assert sorted([await service.double.route_within(3.0, n) for n in (1, 2)]) == [2, 4]
        finally:
            await shutdown()

    asyncio.run(main())


def test_a_lone_actor_that_misses_a_deadline_is_killed_and_named():
    async def main():
        await init_provisioner(ProvisionerConfig())
        worker = await Worker.options(mesh_name="lonely").as_actor()
        try:
            assert await worker.double.route_within(3.0, 4) == 8
            pid = await worker.pid.route()
            stopped(pid)
            with pytest.raises(
                ActorHungError, match=r"actor lonely_\d+ hung: no answer to double\(\) within 2 s"
            ):
                await worker.double.route_within(2.0, 4)
            await wait_until(lambda: gone(pid), 10, "the hung process to be killed")
        finally:
            await shutdown()

    asyncio.run(main())


def test_a_mesh_that_does_not_stop_in_time_has_its_processes_killed():
    async def main():
        await init_provisioner(ProvisionerConfig(stop_timeout_s=2.0))
        worker = await Worker.options(mesh_name="frozen").as_actor()
        pid = await worker.pid.route()
        stopped(pid)  # it can no longer exit when asked
        started = asyncio.get_running_loop().time()
        await shutdown()
        assert asyncio.get_running_loop().time() - started < 15
        await wait_until(lambda: gone(pid), 10, "the frozen process to be killed")

    asyncio.run(main())
