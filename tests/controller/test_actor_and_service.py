"""ForgeActor as an actor and as a 2-replica service, with a replica killed mid-request."""

import asyncio
import gc
import os
import signal

import pytest
from monarch.actor import ActorError, endpoint

from forge.controller import (
    ForgeActor,
    NoHealthyReplicaError,
    ProvisionerConfig,
    Service,
    get_provisioner,
    init_provisioner,
    shutdown,
)

pytestmark = pytest.mark.slow


class Counter(ForgeActor):
    def __init__(self, start: int):
        self.value = start
        self.ready = False

    @endpoint
    async def setup(self):
        self.ready = True

    @endpoint
    async def add(self, n: int) -> int:
        assert self.ready, "setup() must run before any other endpoint"
        self.value += n
        return self.value

    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def env(self, name: str) -> str | None:
        return os.environ.get(name)

    @endpoint
    async def gc_enabled(self) -> bool:
        return gc.isenabled()

    @endpoint
    async def slow_pid(self, seconds: float) -> int:
        await asyncio.sleep(seconds)
        return os.getpid()

    @endpoint
    async def fail(self) -> None:
        raise ValueError("bad request")


def run(coro):
    return asyncio.run(coro)


async def _wait_until(predicate, timeout: float, what: str):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.1)


def test_actor_options_setup_env_and_shutdown():
    frozen = gc.get_freeze_count()

    async def main():
        configured = Counter.options(procs=1, mesh_name="counter")
        assert issubclass(configured, Counter) and configured.procs == 1
        actor = await configured.as_actor(10)
        assert await actor.add.route(5) == 15
        assert await actor.add.route(1) == 16
        # The provisioner gives every process a torch.distributed environment.
        assert await actor.env.route("WORLD_SIZE") == "1"
        assert await actor.env.route("RANK") == "0"
        assert await actor.env.route("MASTER_PORT") is not None
        pid = await actor.pid.route()
        # Its process started with garbage collection off (its imports run faster) and has it on
        # again since the actor was made (forge.mesh_process).
        assert await actor.gc_enabled.route()
        # A lone actor is a service of one replica that nothing replaces: the same calls work.
        assert isinstance(actor, Service) and not actor.replaces_failed_replicas
        assert await actor.add.fanout(1) == [17]
        async with actor.session():
            assert await actor.add.route_within(10, 1) == 18
        await Counter.shutdown(actor)
        await _wait_until(lambda: not _alive(pid), 10, "the actor's process to exit")
        with pytest.raises(ValueError, match="already stopped"):
            await Counter.shutdown(actor)
        await shutdown()

    run(main())
    # Stopping an actor froze its own process's objects for the exit, not this program's (whose
    # frozen objects, if an import froze some, only die off).
    assert gc.isenabled() and gc.get_freeze_count() <= frozen


def test_an_actor_on_several_processes_answers_from_rank_0_or_from_every_rank():
    async def main():
        pair = await Counter.options(procs=2).as_actor(0)
        assert await pair.env.route("RANK") == "0"
        assert await pair.env.route_per_rank("RANK") == ["0", "1"]
        assert await pair.add.fanout(2) == [2]  # every rank ran it; rank 0 answers for the replica
        assert await pair.add.route_per_rank(1) == [3, 3]
        await shutdown()

    run(main())


def test_options_rejects_unknown_option():
    with pytest.raises(TypeError, match="unknown option"):
        Counter.options(replicas=2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; it is only waiting to be reaped.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_service_routing_and_replica_replacement():
    async def main():
        svc = await Counter.options(num_replicas=2).as_service(0)
        pids = await svc.pid.fanout()
        assert len(set(pids)) == 2
        pid_of = {r.name: pid for r, pid in zip(svc.replicas, pids, strict=True)}

        # Calls made one after another take turns between the two replicas.
        routed = [await svc.pid.route() for _ in range(4)]
        assert routed[0] != routed[1] and routed[:2] == routed[2:]

        # While one replica runs a long call, every call goes to the idle one (in turn, every
        # other call would wait behind the long one: a rollout behind a busy generator replica).
        long_call = asyncio.ensure_future(svc.slow_pid.route(3.0))
        await _wait_until(lambda: any(r.inflight for r in svc.replicas), 5, "the long call to start")
        busy_pid = pid_of[next(r for r in svc.replicas if r.inflight).name]
        assert {await svc.pid.route() for _ in range(3)} == set(pids) - {busy_pid}
        assert not long_call.done()
        assert await long_call == busy_pid

        # A session sticks to one replica: its state accumulates on that replica only.
        async with svc.session():
            values = [await svc.add.route(1) for _ in range(3)]
            session_pids = {await svc.pid.route() for _ in range(3)}
        assert values == [1, 2, 3]
        assert len(session_pids) == 1

        # An exception raised by the endpoint is the caller's: it propagates, no replica is lost.
        with pytest.raises(ActorError, match="bad request"):
            await svc.fail.route()
        assert all(r.healthy for r in svc.replicas)

        # Kill the process of the replica that the next request lands on, while it is in flight.
        in_flight = asyncio.ensure_future(svc.slow_pid.route(3.0))
        await _wait_until(lambda: any(r.inflight for r in svc.replicas), 5, "the request to start")
        victim = next(r for r in svc.replicas if r.inflight)
        victim_pid = pid_of[victim.name]
        os.kill(victim_pid, signal.SIGKILL)

        # The request is retried once on the healthy replica and succeeds there.
        survivor_pid = await asyncio.wait_for(in_flight, 30)
        assert survivor_pid != victim_pid and survivor_pid in pids

        # The health loop replaces the dead replica with a fresh process that ran setup().
        await _wait_until(
            lambda: svc.replacements == 1 and all(r.healthy for r in svc.replicas),
            60,
            "the replica to be replaced",
        )
        new_pids = await svc.pid.fanout()
        assert len(set(new_pids)) == 2 and victim_pid not in new_pids
        assert sorted(await svc.add.fanout(5))[0] == 5  # the replacement started from scratch
        stats = svc.stats()
        assert [s["healthy"] for s in stats] == [True, True]
        assert sum(s["failures"] for s in stats) == 1  # the death is counted once
        assert sum(s["served"] for s in stats) > 0 and all(s["inflight"] == 0 for s in stats)

        await Counter.shutdown(svc)
        with pytest.raises(NoHealthyReplicaError):
            await svc.pid.route()
        await (await get_provisioner()).shutdown()
        await shutdown()

    run(main())


def test_gpus_are_given_out_per_mesh_from_the_users_visible_devices(monkeypatch):
    # The provisioner only hands out device ids, so this runs on a CPU machine too.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")

    async def main():
        first = await Counter.options(with_gpus=True, gpu_group="trainer").as_actor(0)
        second = await Counter.options(with_gpus=True).as_actor(0)
        seen = await first.env.route("CUDA_VISIBLE_DEVICES")
        # Each mesh sees its own GPU first (its cuda:0), then the others (for CUDA IPC).
        assert {seen, await second.env.route("CUDA_VISIBLE_DEVICES")} == {"3,5", "5,3"}
        # A mesh of the same GPU group gets the group's GPU instead of a third one.
        sharing = await Counter.options(with_gpus=True, gpu_group="trainer").as_actor(0)
        assert await sharing.env.route("CUDA_VISIBLE_DEVICES") == seen
        with pytest.raises(RuntimeError, match="needs 1 GPU\\(s\\) but all GPUs are taken"):
            await Counter.options(with_gpus=True).as_actor(0)
        with pytest.raises(RuntimeError, match="needs 2 GPU\\(s\\) but its GPU group 'trainer' has 1"):
            await Counter.options(procs=2, with_gpus=True, gpu_group="trainer").as_actor(0)
        await Counter.shutdown(first)
        with pytest.raises(RuntimeError, match="all GPUs are taken"):  # `sharing` still uses it
            await Counter.options(with_gpus=True).as_actor(0)
        await Counter.shutdown(sharing)
        third = await Counter.options(with_gpus=True).as_actor(0)
        assert await third.env.route("CUDA_VISIBLE_DEVICES") == seen  # a stopped group gives its GPU back
        cpu_only = await Counter.as_actor(0)
        assert await cpu_only.env.route("CUDA_VISIBLE_DEVICES") == ""  # no GPU asked for, none visible
        await shutdown()

    run(main())


def test_colocate_puts_every_gpu_mesh_on_the_same_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")

    async def main():
        await init_provisioner(ProvisionerConfig(colocate=True))
        meshes = [await Counter.options(with_gpus=True).as_actor(0) for _ in range(3)]
        assert [await m.env.route("CUDA_VISIBLE_DEVICES") for m in meshes] == ["3,5"] * 3
        await shutdown()

    run(main())
