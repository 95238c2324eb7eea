"""StepVersions against a model of vLLM's batch queue (asynchronous scheduling is GPU-only in
vLLM, so the real queue never runs here; bench/in_flight_check.py checks it on a GPU): every
step's tokens are said to come from the version the step was launched under, wherever the
updates land."""

import random
from collections import deque
from types import SimpleNamespace

import pytest

from forge.engines.vllm_steps import StepVersions, batch_queue


class QueuedEngine:
    """vLLM's ``EngineCore.step_with_batch_queue`` as it uses its queue: launch a step while there
    is work, return nothing while the queue has room, else return the oldest step's tokens.
    ``weights`` is the version loaded now; each launched step records it as the truth."""

    def __init__(self, depth: int, steps_of_work: int):
        self.queue: deque = deque(maxlen=depth)
        self.depth, self.work, self.weights = depth, steps_of_work, 0

    def step(self) -> list:
        if self.work:
            self.work -= 1
            self.queue.appendleft(self.weights)
            if len(self.queue) < self.depth and self.work:
                return []
        if not self.queue:
            return []
        return [f"tokens of weights {self.queue.pop()}"]


@pytest.mark.parametrize("depth", [2, 3])
def test_each_steps_tokens_are_stamped_with_the_weights_it_was_launched_under(depth):
    rng = random.Random(depth)
    engine = QueuedEngine(depth, steps_of_work=200)
    steps = StepVersions(engine.queue)
    version = 0
    stamped = []
    while engine.work or engine.queue:
        if rng.random() < 0.3:  # an update between two calls, as the engine thread applies one
            version += 1
            engine.weights = version
        outputs, produced_by = steps.step(engine.step, version)
        stamped += [(output, f"tokens of weights {produced_by}") for output in outputs]
    assert len(stamped) == 200 and version > 50
    assert all(truth == said for truth, said in stamped)
    # The stamp is not simply the version loaded when the tokens came back.
    assert any(said != f"tokens of weights {version}" for _, said in stamped)


def test_without_a_queue_a_step_is_the_weights_of_the_moment():
    steps = StepVersions(None)
    assert steps.step(lambda: ["tokens"], 7) == (["tokens"], 7)


def test_a_queue_changed_behind_its_back_is_an_error_not_a_wrong_stamp():
    engine = QueuedEngine(2, steps_of_work=10)
    steps = StepVersions(engine.queue)
    steps.step(engine.step, 0)
    engine.queue.appendleft(0)  # a step StepVersions never saw launched
    with pytest.raises(RuntimeError, match="lost track of vLLM's queued steps"):
        steps.step(engine.step, 0)


def llm_with(async_scheduling: bool, queue):
    """The attributes of `vllm.LLM` that `batch_queue` reads (the real engine core is CPU-only
    here, where vLLM never schedules asynchronously)."""
    config = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))
    core = SimpleNamespace(engine_core=SimpleNamespace(batch_queue=queue))
    return SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=config, engine_core=core))


def test_a_vllm_that_schedules_ahead_without_a_visible_queue_is_refused():
    queue = deque(maxlen=2)
    assert batch_queue(llm_with(True, queue), "generator") is queue
    assert batch_queue(llm_with(False, None), "generator") is None
    with pytest.raises(
        RuntimeError, match="generator: vLLM .* schedules asynchronously and forge cannot see"
    ):
        batch_queue(llm_with(True, None), "generator")
