"""The placement planner on described machines (no GPU needed), its refusals, and the provisioner
handing out the plan's slots (the GRPO config's request: tests/grpo/test_grpo_placement.py)."""

import pytest

from forge.controller.gpu_plan import (
    GENERATOR_GROUP,
    TRAINER_GROUP,
    Machine,
    PlacementError,
    PlacementRequest,
    plan_gpus,
)
from forge.controller.gpu_pool import GpuPool
from forge.controller.provisioner import Provisioner, ProvisionerConfig


def slots(plan):
    return plan.slots[TRAINER_GROUP][0], plan.slots[GENERATOR_GROUP]


def test_colocated_each_gpu_holds_a_trainer_rank_and_a_replica():
    plan = plan_gpus(PlacementRequest(trainer_procs=2, generator_replicas=2, colocate=True), Machine(2))
    assert slots(plan) == ([0, 1], [[0], [1]])
    plan = plan_gpus(PlacementRequest(trainer_procs=4, generator_replicas=4, colocate=True), Machine(4))
    assert slots(plan) == ([0, 1, 2, 3], [[0], [1], [2], [3]])


def test_colocated_generator_with_tensor_parallelism_spans_gpus():
    request = PlacementRequest(trainer_procs=4, generator_replicas=2, generator_tp=2, colocate=True)
    assert slots(plan_gpus(request, Machine(4))) == ([0, 1, 2, 3], [[0, 1], [2, 3]])
    one = PlacementRequest(trainer_procs=2, generator_replicas=1, generator_tp=2, colocate=True)
    assert slots(plan_gpus(one, Machine(2))) == ([0, 1], [[0, 1]])


def test_disaggregated_generators_take_the_gpus_after_the_trainer():
    request = PlacementRequest(trainer_procs=2, generator_replicas=2, colocate=False)
    assert slots(plan_gpus(request, Machine(4))) == ([0, 1], [[2], [3]])
    tp = PlacementRequest(trainer_procs=1, generator_replicas=1, generator_tp=2, colocate=False)
    plan = plan_gpus(tp, Machine(4))
    assert slots(plan) == ([0], [[1, 2]])
    assert "unused: GPU 3" in plan.describe()


def test_replicas_share_a_gpu_when_asked_and_their_memory_shares_add_up():
    def two_a_gpu(procs: int, replicas: int, colocate: bool, share: float = 0.0) -> PlacementRequest:
        return PlacementRequest(
            trainer_procs=procs,
            generator_replicas=replicas,
            generator_replicas_per_gpu=2,
            colocate=colocate,
            generator_share=share,
        )

    apart = two_a_gpu(1, 3, colocate=False)
    assert slots(plan_gpus(apart, Machine(3))) == ([0], [[1], [1], [2]])
    two_by_two = two_a_gpu(2, 4, colocate=True, share=0.2)
    assert slots(plan_gpus(two_by_two, Machine(2, memory_gib=80))) == ([0, 1], [[0], [0], [1], [1]])
    with pytest.raises(PlacementError, match=r"= 3 GPUs"):
        plan_gpus(apart, Machine(2))
    crowded = two_a_gpu(1, 2, colocate=False, share=0.6)
    with pytest.raises(
        PlacementError,
        match=r"GPU 1 \(80 GiB\).*0.6 for each of 2 replicas.*\(~96.0 GiB\).*lower generator.replicas_per_gpu",
    ):
        plan_gpus(crowded, Machine(2, memory_gib=80))


def test_disaggregated_reward_models_with_gpus_of_their_own_come_last():
    request = PlacementRequest(
        trainer_procs=1, generator_replicas=2, colocate=False, own_gpus={"reward model judge": 1}
    )
    plan = plan_gpus(request, Machine(4))
    assert slots(plan) == ([0], [[1], [2]]) and plan.own_gpus == {"reward model judge": [3]}
    described = plan.describe(["4", "5", "6", "7"])  # the GPUs' own names
    assert "trainer (and reference model): GPU 4" in described
    assert "generator replica 1: GPU 6" in described and "reward model judge: GPU 7" in described


@pytest.mark.parametrize(
    "request_, machine, keys",
    [
        (
            PlacementRequest(trainer_procs=4, generator_replicas=1, colocate=True),
            Machine(2),
            ["trainer.procs (4)"],
        ),
        (
            PlacementRequest(trainer_procs=2, generator_replicas=3, colocate=True),
            Machine(2),
            ["provisioner.colocate=true", "generator.replicas (3)", "tensor_parallel_size (1)"],
        ),
        (
            PlacementRequest(trainer_procs=2, generator_replicas=2, generator_tp=2, colocate=False),
            Machine(4),
            ["trainer.procs (2) + generator.replicas (2) x", "= 6 GPUs", "set provisioner.colocate=true"],
        ),
        (
            PlacementRequest(
                trainer_procs=1, generator_replicas=1, colocate=False, own_gpus={"reward model judge": 1}
            ),
            Machine(2),
            ["reward model judge (1)", "= 3 GPUs"],
        ),
        (
            PlacementRequest(
                trainer_procs=1, generator_replicas=1, generator_tp=3, colocate=False, attention_heads=(16, 8)
            ),
            Machine(4),
            ["generator.vllm.tensor_parallel_size (3)", "16 attention heads"],
        ),
        (
            PlacementRequest(trainer_procs=2, generator_replicas=2, colocate=True, weight_broadcast=True),
            Machine(2),
            ["generator.weight_transport=broadcast", "GPU [0, 1]", "provisioner.colocate=false"],
        ),
        (
            PlacementRequest(
                trainer_procs=1,
                generator_replicas=2,
                generator_replicas_per_gpu=2,
                colocate=False,
                weight_broadcast=True,
            ),
            Machine(2),
            ["GPU [1]", "replicas_per_gpu > 1"],
        ),
    ],
)
def test_refusals_name_the_keys(request_, machine, keys):
    with pytest.raises(PlacementError) as refused:
        plan_gpus(request_, machine)
    for key in keys:
        assert key in str(refused.value)


def test_broadcast_takes_a_gpu_per_trainer_rank_and_per_replica():
    request = PlacementRequest(
        trainer_procs=2, generator_replicas=1, generator_tp=2, colocate=False, weight_broadcast=True
    )
    assert slots(plan_gpus(request, Machine(4))) == ([0, 1], [[2, 3]])


def test_tensor_parallelism_may_replicate_fewer_key_value_heads():
    request = PlacementRequest(
        trainer_procs=1, generator_replicas=1, generator_tp=4, colocate=True, attention_heads=(32, 2)
    )
    assert slots(plan_gpus(request, Machine(4)))[1] == [[0, 1, 2, 3]]


def test_memory_that_a_gpu_cannot_hold_is_refused():
    colocated = PlacementRequest(
        trainer_procs=1, generator_replicas=1, colocate=True, generator_share=0.5, trainer_gib=50.0
    )
    with pytest.raises(
        PlacementError, match=r"GPU 0 \(80 GiB\).*\(~50.0 GiB\).*utilization 0.5 \(~40.0 GiB\)"
    ):
        plan_gpus(colocated, Machine(1, memory_gib=80))
    # On a GPU of its own the trainer fits, and vLLM's share is its GPU's alone.
    apart = PlacementRequest(
        trainer_procs=1, generator_replicas=1, colocate=False, generator_share=0.9, trainer_gib=50.0
    )
    plan_gpus(apart, Machine(2, memory_gib=80))
    too_big = PlacementRequest(trainer_procs=1, generator_replicas=1, colocate=False, trainer_gib=130.0)
    with pytest.raises(PlacementError, match="raise trainer.procs"):
        plan_gpus(too_big, Machine(2, memory_gib=80))
    # Unknown memory: nothing to check.
    plan_gpus(colocated, Machine(1))


def test_the_pool_hands_each_replica_its_slot_and_a_replacement_the_slot_left():
    plan = plan_gpus(PlacementRequest(trainer_procs=2, generator_replicas=2, colocate=False), Machine(4))
    pool = GpuPool(["4", "5", "6", "7"], plan)  # the GPUs as CUDA_VISIBLE_DEVICES names them
    taken = {
        "trainer": pool.take(2, "trainer", TRAINER_GROUP),
        "reference": pool.take(2, "reference", TRAINER_GROUP),
        "gen0": pool.take(1, "gen0", GENERATOR_GROUP),
        "gen1": pool.take(1, "gen1", GENERATOR_GROUP),
    }
    assert taken == {"trainer": ["4", "5"], "reference": ["4", "5"], "gen0": ["6"], "gen1": ["7"]}
    pool.give_back(taken["gen0"], GENERATOR_GROUP)  # replica 0 died
    assert pool.take(1, "gen0-replacement", GENERATOR_GROUP) == ["6"]
    # A GPU mesh outside the plan takes what the plan left: nothing here.
    with pytest.raises(RuntimeError, match="all GPUs are taken"):
        pool.take(1, "classifier")


def test_colocated_replicas_take_their_slots_in_order_beside_the_trainer():
    plan = plan_gpus(PlacementRequest(trainer_procs=1, generator_replicas=2, colocate=True), Machine(2))
    pool = GpuPool(["0", "1"], plan, colocate=True)
    assert pool.take(1, "trainer", TRAINER_GROUP) == ["0"]
    assert [pool.take(1, f"gen{i}", GENERATOR_GROUP) for i in range(2)] == [["0"], ["1"]]


def test_the_provisioner_takes_its_gpus_from_the_plan(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    plan = plan_gpus(PlacementRequest(trainer_procs=1, generator_replicas=1, colocate=False), Machine(2))
    provisioner = Provisioner(ProvisionerConfig(), plan=plan)
    assert provisioner._gpus_for(1, "Generator_0", GENERATOR_GROUP) == ["5"]


def test_a_fixed_kv_cache_and_the_receive_buffers_count_for_every_replica_on_a_gpu():
    def two_a_gpu(buffers_gib: float) -> PlacementRequest:
        return PlacementRequest(
            trainer_procs=1,
            generator_replicas=2,
            generator_replicas_per_gpu=2,
            colocate=False,
            generator_share=0.1,  # not used: the KV cache has a size (generator_gib)
            generator_gib=30.0,
            generator_buffers_gib=buffers_gib,
            trainer_gib=10.0,
            trainer_buffers_gib=5.0,
        )

    assert slots(plan_gpus(two_a_gpu(5.0), Machine(2, memory_gib=80))) == ([0], [[1], [1]])
    with pytest.raises(
        PlacementError,
        match=r"GPU 1 \(80 GiB\) cannot hold vLLM's weights, KV cache \(generator.vllm.kv_cache_memory_gib\) "
        r"and runtime for each of 2 replicas .*\(~60.0 GiB\) and the generator's receive buffers .*\(~22.0 GiB\): "
        r"lower generator.vllm.kv_cache_memory_gib, or lower generator.replicas_per_gpu$",
    ):
        plan_gpus(two_a_gpu(11.0), Machine(2, memory_gib=80))
