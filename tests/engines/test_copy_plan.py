"""copy_plan: a loader's copies recorded once and replayed, against the loader run on new values.

vLLM's GPU loader (the plan's user) cannot run on CPU; it is checked on a GPU by
bench/vllm_weight_load.py (bench/RESULTS.md). Here: transformers' own `load_state_dict`, and
loaders written like vLLM's fused ones (q, k and v narrowed into one parameter, a padded
vocabulary filled with zeros), plus what must be refused."""

import logging

import pytest
import torch
from hf_checkpoints import tiny_qwen3_config
from transformers import AutoModelForCausalLM

from forge.engines.copy_plan import PlanRejected, ReplayedLoader, record

ROWS = {"q": 4, "k": 2, "v": 2}


def fused_inputs(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    inputs = {name: torch.randn(rows, 3, generator=g) for name, rows in ROWS.items()}
    inputs["embed"] = torch.randn(5, 3, generator=g)
    return inputs


def fused_targets() -> dict[str, torch.Tensor]:
    return {"qkv": torch.full((8, 3), float("nan")), "embed": torch.full((8, 3), float("nan"))}


def fused_load(targets: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> None:
    """Like vLLM's QKVParallelLinear and VocabParallelEmbedding loaders at one GPU."""
    start = 0
    for name, rows in ROWS.items():
        targets["qkv"].data.narrow(0, start, rows).copy_(inputs[name])
        start += rows
    embed = inputs["embed"]
    targets["embed"][: embed.shape[0]].data.copy_(embed)
    targets["embed"][embed.shape[0] :].data.fill_(0)


def test_a_replay_does_what_the_fused_loader_does_on_new_values():
    recorded_into, recorded_from = fused_targets(), fused_inputs(0)
    plan = record(lambda: fused_load(recorded_into, recorded_from), recorded_into, recorded_from)
    assert len(plan.copies) == 4 and len(plan.fills) == 1

    new = fused_inputs(1)
    replayed, loaded = fused_targets(), fused_targets()
    plan.replay(replayed, new)
    fused_load(loaded, new)
    for name in loaded:
        assert torch.equal(replayed[name], loaded[name]), name
    assert torch.equal(replayed["qkv"][4:6], new["k"])  # the check above compares real values


def test_a_replay_of_transformers_load_state_dict_equals_it():
    # Untied: a tied head is the embedding written twice, which a plan refuses (order).
    config = tiny_qwen3_config(64, 2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    first = AutoModelForCausalLM.from_config(config).state_dict()
    targets = lambda: dict(model.named_parameters())  # noqa: E731
    plan = record(lambda: model.load_state_dict(first), targets(), first)

    second = {k: torch.randn_like(v) for k, v in first.items()}
    plan.replay(targets(), second)
    replayed = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(second)
    for name, value in model.state_dict().items():
        assert torch.equal(replayed[name], value), name


def test_a_replay_refuses_inputs_of_another_shape():
    targets, inputs = fused_targets(), fused_inputs(0)
    plan = record(lambda: fused_load(targets, inputs), targets, inputs)
    wrong = fused_inputs(1)
    wrong["q"] = torch.randn(3, 3)
    with pytest.raises(ValueError, match="input 'q'"):
        plan.replay(targets, wrong)


def transposed_load(targets, inputs):
    targets["qkv"].data.narrow(0, 0, 3).copy_(inputs["q"].t().contiguous()[:3, :4][:, :3])


def scaled_load(targets, inputs):
    fused_load(targets, inputs)
    targets["qkv"].data.mul_(2)


def load_changing_input(targets, inputs):
    inputs["q"].add_(1)
    fused_load(targets, inputs)


def overlapping_load(targets, inputs):
    fused_load(targets, inputs)
    targets["qkv"].data.narrow(0, 3, 2).copy_(inputs["v"])


@pytest.mark.parametrize(
    "load, reason",
    [
        (transposed_load, "not an input as it is"),
        (scaled_load, "written by aten.mul_"),
        (load_changing_input, "changes an input in place"),
        (overlapping_load, "written twice"),
        (lambda targets, inputs: None, "copied nothing"),
    ],
)
def test_what_a_replay_could_not_repeat_is_refused(load, reason):
    targets, inputs = fused_targets(), fused_inputs(0)
    with pytest.raises(PlanRejected, match=reason):
        record(lambda: load(targets, inputs), targets, inputs)


class Module(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(8, 3))
        self.embed = torch.nn.Parameter(torch.zeros(8, 3))


def test_the_replayed_loader_replays_after_a_check(monkeypatch):
    module = Module()
    calls = []

    def load(weights):
        calls.append(len(weights))
        with torch.no_grad():
            fused_load(dict(module.named_parameters()), dict(weights))

    loader = ReplayedLoader(load, lambda: dict(module.named_parameters()), "test")
    for seed in range(4):
        inputs = fused_inputs(seed)
        loader(list(inputs.items()))
        assert torch.equal(module.qkv[:4], inputs["q"]) and torch.equal(module.embed[5:], torch.zeros(3, 3))
    # Recorded at the first load, checked against the loader at the second, replayed after.
    assert len(calls) == 2 and loader.checked and not loader.given_up


def test_the_replayed_loader_gives_up_when_the_loader_replaces_a_parameter(caplog):
    module = Module()

    def load(weights):
        inputs = dict(weights)
        with torch.no_grad():
            module.qkv.narrow(0, 0, 4).copy_(inputs["q"])
            module.embed.data = inputs["embed"].repeat(2, 1)[:8].clone()  # not a copy into it

    loader = ReplayedLoader(load, lambda: dict(module.named_parameters()), "test")
    with caplog.at_level(logging.WARNING):
        for seed in range(3):
            inputs = fused_inputs(seed)
            loader(list(inputs.items()))
            assert torch.equal(module.embed[:5], inputs["embed"])  # every load is right
    assert loader.given_up and "a replay left ['embed']" in caplog.text
