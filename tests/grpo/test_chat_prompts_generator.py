"""Rollouts render chat-message prompts with the tokenizer's template and the Generator actor
samples from exactly those ids, for rollouts and for the eval alike; stop strings reach its engine."""

import asyncio
import shutil

import pytest

from forge import store
from forge.actors.generator import Generator, GeneratorConfig
from forge.controller import shutdown
from forge.data.chat_prompts import PromptRenderer
from forge.data.tokenizer import embedded_tokenizer
from forge.envs.turns import TurnRenderer
from forge.observability.collector import pop_state
from forge.rewards.sources import RewardFunctions, RolloutScorer
from forge.rollout.eval import greedy_eval
from forge.rollout.step import Rollouts

pytestmark = pytest.mark.slow

# Role markers and the assistant's turn opened, in characters of the embedded alphabet.
ROLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "add"}, {"role": "user", "content": "12+34="}]


@pytest.fixture(scope="module")
def chat_policy(tiny_policy, tmp_path_factory):
    """The tiny policy with a tokenizer whose chat template adds role markers."""
    path = tmp_path_factory.mktemp("chat_policy") / "policy"
    shutil.copytree(tiny_policy, path)
    tokenizer = embedded_tokenizer()
    tokenizer.chat_template = ROLE_TEMPLATE
    tokenizer.save_pretrained(path)
    return path, tokenizer


def test_completions_carry_the_chat_templated_prompt_ids(chat_policy):
    path, tokenizer = chat_policy
    config = GeneratorConfig(model_path=str(path), sampling={"max_tokens": 12, "seed": 0})
    eval_prompts = []

    async def recording_functions(prompts, responses, targets):  # what the eval's functions see
        eval_prompts.extend(prompt for group in prompts for prompt in group)
        return [[{} for _ in group] for group in responses]

    eval_scorer = RolloutScorer([RewardFunctions(recording_functions, {})], metric_prefix="eval/reward")

    async def main():
        await store.initialize()
        generator = await Generator.as_actor(config)
        try:
            rollouts = Rollouts(generator, TurnRenderer(PromptRenderer(tokenizer, "auto")), max_tokens=12)
            groups = await rollouts.groups([{"prompt": MESSAGES}, {"prompt": "7+8="}], None, 0, 2)
            await greedy_eval(rollouts, [{"prompt": MESSAGES, "target": "46"}], eval_scorer, max_tokens=2)
            # One sample key for both calls: the same draws.
            chat_ids = groups[0][0].prompt_ids
            [free] = await generator.generate.route([chat_ids], [0], n=4)
            # A stop string from a sample: the text of its third and fourth tokens.
            stop = next(text for c in free if (text := decode(c.response_ids[2:4])) and c.response_len >= 4)
            [stopped] = await generator.generate.route([chat_ids], [0], n=4, stop=[stop])
            return groups, free, stopped, stop
        finally:
            await store.shutdown()
            await shutdown()
            pop_state()  # the eval's metrics, which no run's logger takes: not the next test's

    groups, free, stopped, stop = asyncio.run(main())

    chat_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    chat_text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert chat_text.startswith("<bos><system>add\n<user>12+34=\n<assistant>")
    assert all(c.prompt_ids == chat_ids and c.prompt == chat_text for c in groups[0])
    # A string prompt is templated as one user message; its text stays as written.
    as_user = [{"role": "user", "content": "7+8="}]
    user_ids = tokenizer.apply_chat_template(as_user, add_generation_prompt=True)["input_ids"]
    assert user_ids != tokenizer("7+8=").input_ids
    assert all(c.prompt_ids == user_ids and c.prompt == "7+8=" for c in groups[1])
    # The eval scores with the rendered text.
    assert eval_prompts == [chat_text]

    # sampling.stop: the same draws, cut after the first token whose text completes the stop string.
    cuts = 0
    for before, after in zip(free, stopped, strict=True):
        ends = [end for end in range(1, before.response_len + 1) if stop in decode(before.response_ids[:end])]
        if ends:
            assert after.stop_reason == "stop" and after.response_ids == before.response_ids[: ends[0]]
            assert after.logprobs == pytest.approx(before.logprobs[: ends[0]], abs=1e-6)
            cuts += ends[0] < before.response_len
        else:
            assert after == before
    assert cuts > 0


def decode(ids: list[int]) -> str:
    return embedded_tokenizer().decode(ids, skip_special_tokens=True)
