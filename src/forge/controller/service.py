"""Services: k replicas of one actor class, each on its own proc mesh, behind one handle.

Every ForgeActor handle is a `Service`. `as_service()` starts `num_replicas` replicas and
replaces one that dies; `as_actor()` starts a lone actor: one replica that nothing replaces.
Either is called the same way:

    svc = await Policy.options(num_replicas=2).as_service(model_path)
    out = await svc.generate.route(prompt)              # one replica: the least busy
    out = await svc.generate.route_within(60, prompt)   # the same, answered within 60 s
    outs = await svc.update_weights.fanout(v)           # every healthy replica
    async with svc.session():                           # calls in here stick to one replica
        ...
    trainer = await Trainer.options(procs=2).as_actor(cfg)
    loss = await trainer.train_step.route(batch)        # every rank runs it; rank 0 answers
    shares = await trainer.evaluate.route_per_rank(x)   # every rank's answer, in rank order

When a replica's process dies, Monarch's supervision tells the service (see
`supervision.py`); the replica is marked unhealthy at once, a request in flight on it is
retried on a healthy replica (once per replica, waiting for a replacement when none is
left), and the health loop replaces it with a fresh mesh
(`setup` runs again). An exception raised by the endpoint itself is the caller's, not a
replica failure: it propagates and is not retried.

A replica that hangs while alive is made a dead one (forge.controller.liveness): a call made
with a deadline (`route_within`) that it misses, or a probe of an idle replica that it does not
answer, has its processes killed, and the above follows.

A lone actor's death is no replica failure: nothing replaces it, so supervision reports it as
unrecoverable (the program stops, or its `on_unrecoverable` handler decides), and a call on it
raises Monarch's error unchanged. One that misses a call's deadline is killed, and the call
raises `ActorHungError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import itertools
import logging
import time
from typing import Any

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

import forge.controller.supervision as supervision
from forge.controller.liveness import ActorHungError, Probe
from forge.controller.provisioner import get_provisioner
from forge.controller.replica import Replica, launch
from forge.observability import Reduce, record_metric

logger = logging.getLogger(__name__)

# How long a call waits, while every replica is being replaced, for one to be back (a vLLM
# replica's cold start on a GPU takes about two minutes).
REPLACEMENT_WAIT_S = 600.0


class ReplicaFailedError(RuntimeError):
    """The replica serving a request died (its process failed)."""


class ReplicaHungError(ReplicaFailedError):
    """The replica serving a request missed its deadline (it was killed)."""


class NoHealthyReplicaError(RuntimeError):
    pass


def _hung_actor_ended(name: str, report: str) -> None:
    logger.info("%s was killed after it hung", name)


# Service -> replica index that calls inside its `session()` stick to.
_sticky: contextvars.ContextVar[dict[Service, int] | None] = contextvars.ContextVar(
    "forge_sticky", default=None
)


class ServiceEndpoint:
    """An endpoint of a service's actor class, called on one replica or on every healthy one."""

    def __init__(self, service: Service, name: str):
        self._service = service
        self._name = name

    async def route(self, *args: Any, **kwargs: Any) -> Any:
        """The answer of one replica (the routing's choice, or the session's); a replica of
        several processes runs the call on every rank, and rank 0 answers for it."""
        return (await self._service._route(self._name, args, kwargs))[0]

    async def route_within(self, seconds: float, /, *args: Any, **kwargs: Any) -> Any:
        """`route`, answered within `seconds`: a replica that misses it is killed, and replaced
        with the call retried on another replica; a lone actor raises `ActorHungError`."""
        return (await self._service._route(self._name, args, kwargs, deadline_s=seconds))[0]

    async def route_per_rank(self, *args: Any, **kwargs: Any) -> list[Any]:
        """`route`, with the answer of every rank of the replica, in rank order (an actor whose
        ranks each answer for their own share)."""
        return await self._service._route(self._name, args, kwargs)

    async def fanout(self, *args: Any, **kwargs: Any) -> list[Any]:
        """The answers of every healthy replica (rank 0's of each)."""
        return await self._service._fanout(self._name, args, kwargs)


class Service:
    """The handle of an actor class's replicas: `handle.<endpoint>` is a `ServiceEndpoint`."""

    def __init__(
        self,
        actor_cls,
        args: tuple,
        kwargs: dict,
        num_replicas: int,
        health_interval_s: float = 0.2,
        probe: Probe | None = None,
        replace_failed: bool = True,
    ):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not replace_failed and (num_replicas != 1 or probe is not None):
            raise ValueError("a service that replaces no replica is a lone actor: one replica, no probe")
        self._cls = actor_cls
        self._args, self._kwargs = args, kwargs
        self._num_replicas = num_replicas
        self._health_interval_s = health_interval_s
        self._probe = probe
        self._probes: set[asyncio.Task] = set()
        self._name = actor_cls._actor_class().__name__
        self._turns = itertools.count()
        self.replicas: list[Replica] = []
        # False: a lone actor (`as_actor`), whose death or hang is the program's to handle.
        self.replaces_failed_replicas = replace_failed
        self._health_task: asyncio.Task | None = None
        self._stopping = False
        self._stopped = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.replacements = 0

    def __getattr__(self, name: str) -> ServiceEndpoint:
        if name.startswith("_") or not hasattr(self._cls, name):
            raise AttributeError(f"{self._name} has no endpoint '{name}'")
        return ServiceEndpoint(self, name)

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._provisioner = await get_provisioner()
        self.replicas = list(
            await asyncio.gather(*(self._start_replica(i) for i in range(self._num_replicas)))
        )
        if self.replaces_failed_replicas:
            self._health_task = asyncio.create_task(self._health_loop(), name=f"{self._name}-health")
            self._provisioner.add_supervisor(self.stop)

    async def _start_replica(self, index: int) -> Replica:
        name = self._cls._unique_name()
        if not self.replaces_failed_replicas:
            return await launch(self._cls, index, name, self._args, self._kwargs)
        holder: list[Replica] = []

        def on_failure(report: str) -> None:  # called from a Monarch thread
            if holder and self._loop is not None:
                self._loop.call_soon_threadsafe(holder[0].mark_failed, report)

        supervision.register(name, on_failure)
        holder.append(await launch(self._cls, index, name, self._args, self._kwargs))
        return holder[0]

    async def _health_loop(self) -> None:
        next_probe = time.monotonic()
        while not self._stopping:
            for replica in list(self.replicas):
                if not replica.healthy:
                    await self._replace(replica)
            if self._probe is not None and time.monotonic() >= next_probe:
                next_probe = time.monotonic() + self._probe.every_s
                for replica in self.replicas:
                    # A busy replica is watched by its calls' deadlines.
                    if replica.healthy and not replica.inflight and not replica.probing:
                        task = asyncio.create_task(self._probe_one(replica))
                        self._probes.add(task)
                        task.add_done_callback(self._probes.discard)
            await asyncio.sleep(self._health_interval_s)

    async def _probe_one(self, replica: Replica) -> None:
        replica.probing = True
        try:
            await asyncio.wait_for(replica.answers("process", (), {}), self._probe.timeout_s)
        except TimeoutError:
            self._hung(replica, f"no answer to a health probe within {self._probe.timeout_s:g} s")
        except Exception:
            pass  # it died: supervision has reported it
        finally:
            replica.probing = False

    def _hung(self, replica: Replica, why: str) -> None:
        """A replica that stopped answering is made a dead one: marked failed (the health loop
        replaces it) and its processes killed, which it cannot refuse."""
        if not replica.healthy:
            return
        record_metric(f"service/{self._name}/hung", 1, Reduce.SUM)
        replica.mark_failed(f"hung: {why}")
        self._provisioner.kill_proc_mesh(replica.mesh)

    async def _replace(self, old: Replica) -> None:
        logger.warning("replacing replica %s of %s", old.name, self._name)
        # Stopping its mesh declares it stopped on purpose (supervision.stopped_on_purpose): the
        # death of a replica killed for hanging is often reported after this replacement starts.
        provisioner = await get_provisioner()
        await provisioner.stop_proc_mesh(old.mesh)
        try:
            new = await self._start_replica(old.index)
        except Exception:
            logger.exception("could not start a replacement for %s; will try again", old.name)
            return
        new.failures = old.failures
        self.replicas[self.replicas.index(old)] = new
        self.replacements += 1

    async def stop(self) -> None:
        if self._stopped:
            raise ValueError(f"shutdown(): this {self._name} handle is already stopped")
        self._stopped = True
        provisioner = await get_provisioner()
        provisioner.remove_supervisor(self.stop)
        # Not cancelled: a replacement being spawned finishes (Monarch does not take a spawn
        # cancelled halfway well), joins the replicas, and is stopped below with them.
        self._stopping = True
        if self._health_task is not None:
            await self._health_task
        for task in list(self._probes):
            task.cancel()
        await asyncio.gather(*(provisioner.stop_proc_mesh(replica.mesh) for replica in self.replicas))
        self.replicas = []

    # ---- routing ---------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def session(self):
        """Calls routed inside this block go to one replica (a new one if it dies)."""
        sticky = dict(_sticky.get() or {})
        sticky.pop(self, None)
        token = _sticky.set(sticky)
        try:
            yield
        finally:
            _sticky.reset(token)

    def _healthy(self) -> list[Replica]:
        healthy = [r for r in self.replicas if r.healthy]
        if not healthy:
            raise NoHealthyReplicaError(f"{self._name}: no healthy replica (all {len(self.replicas)} failed)")
        return healthy

    def _choose(self) -> Replica:
        sticky = _sticky.get()
        if sticky is not None:
            chosen = next((r for r in self.replicas if r.index == sticky.get(self) and r.healthy), None)
            if chosen is not None:
                return chosen
        # The replica with the fewest calls in flight, of those the one chosen longest ago: calls
        # made one after another take turns, and a call never waits behind a busy replica while
        # another is idle (a GRPO rollout is one long generate call; sent in turn to a replica
        # still running its last, it would wait there for that one to end while another idled).
        chosen = min(self._healthy(), key=lambda r: (r.inflight, r.last_chosen))
        chosen.last_chosen = next(self._turns)
        if sticky is not None:
            sticky[self] = chosen.index
        return chosen

    async def _route(
        self, endpoint_name: str, args: tuple, kwargs: dict, deadline_s: float | None = None
    ) -> list[Any]:
        # A call whose replica fails is retried elsewhere, once per replica: a second replica
        # may fail with the first (a host lost, a shared cause), and a retry then waits for a
        # replacement rather than fail the call.
        for retries_left in range(self._num_replicas, -1, -1):
            await self._wait_for_a_replica()
            try:
                return await self._call(self._choose(), endpoint_name, args, kwargs, deadline_s)
            except ReplicaFailedError:
                if not retries_left:
                    raise

    async def _wait_for_a_replica(self) -> None:
        """While every replica is being replaced, waits for one to be back (at most
        `REPLACEMENT_WAIT_S`; then, or once the service stops, `_choose` raises)."""
        deadline = time.monotonic() + REPLACEMENT_WAIT_S
        while (
            not any(r.healthy for r in self.replicas) and not self._stopping and time.monotonic() < deadline
        ):
            await asyncio.sleep(self._health_interval_s)

    async def _fanout(self, endpoint_name: str, args: tuple, kwargs: dict) -> list[Any]:
        results = await asyncio.gather(
            *(self._call(r, endpoint_name, args, kwargs) for r in self._healthy()), return_exceptions=True
        )
        # A replica that died during the call is no longer one of "every healthy replica": its
        # replacement starts afresh (setup runs again). Any other error is the caller's.
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, ReplicaFailedError):
                raise result
        return [r[0] for r in results if not isinstance(r, ReplicaFailedError)]

    async def _call(
        self, replica: Replica, endpoint_name: str, args: tuple, kwargs: dict, deadline_s: float | None = None
    ) -> list[Any]:
        """Every rank's answer of `replica`, in rank order."""
        if not self.replaces_failed_replicas:
            return await self._call_lone_actor(replica, endpoint_name, args, kwargs, deadline_s)
        key = f"service/{self._name}/replica{replica.index}"
        replica.inflight += 1
        record_metric(f"{key}/queue_depth", replica.inflight, Reduce.MAX)
        started = time.perf_counter()
        call_task = asyncio.ensure_future(replica.answers(endpoint_name, args, kwargs))
        # Its outcome is read even when nobody waits for it any more (this caller cancelled as
        # the call failed at the end of a run): asyncio would log it as never retrieved.
        call_task.add_done_callback(_read_outcome)
        failed_task = asyncio.ensure_future(replica.failed.wait())
        try:
            await asyncio.wait(
                {call_task, failed_task}, timeout=deadline_s, return_when=asyncio.FIRST_COMPLETED
            )
            if not call_task.done():
                if not failed_task.done():
                    self._hung(replica, f"no answer to {endpoint_name}() within {deadline_s:.0f} s")
                    raise ReplicaHungError(f"replica {replica.name} hung during {endpoint_name}()")
                raise ReplicaFailedError(f"replica {replica.name} died during {endpoint_name}()")
            try:
                answers = call_task.result()
            except SupervisionError as e:
                replica.mark_failed(str(e))
                raise ReplicaFailedError(f"replica {replica.name} died during {endpoint_name}()") from e
        except ReplicaFailedError:
            record_metric(f"{key}/failures", 1, Reduce.SUM)
            raise
        finally:
            failed_task.cancel()
            call_task.cancel()  # no answer in time, a dead replica, or this caller cancelled
            replica.inflight -= 1
        replica.served += 1
        record_metric(f"{key}/latency_ms", (time.perf_counter() - started) * 1e3, Reduce.MEAN)
        return answers

    async def _call_lone_actor(
        self, replica: Replica, endpoint_name: str, args: tuple, kwargs: dict, deadline_s: float | None
    ) -> list[Any]:
        """The call on a replica that nothing replaces: its failure is raised as Monarch raised
        it, and one that misses `deadline_s` is killed (its death expected: only logged)."""
        call = replica.answers(endpoint_name, args, kwargs)
        if deadline_s is None:
            return await call
        try:
            return await asyncio.wait_for(call, deadline_s)
        except TimeoutError:
            supervision.register(replica.name, functools.partial(_hung_actor_ended, replica.name))
            self._provisioner.kill_proc_mesh(replica.mesh)
            raise ActorHungError(
                f"actor {replica.name} hung: no answer to {endpoint_name}() within {deadline_s:.0f} s (its "
                "process was killed); raise the deadline if the call was only slow"
            ) from None

    def stats(self) -> list[dict[str, Any]]:
        return [
            {
                "replica": r.index,
                "name": r.name,
                "healthy": r.healthy,
                "inflight": r.inflight,
                "served": r.served,
                "failures": r.failures,
            }
            for r in self.replicas
        ]


def _read_outcome(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()
