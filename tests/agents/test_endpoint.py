"""forge's agent endpoint with the real `openai` client on localhost, samples from a real tiny
Qwen3 (transformers' generation): what each episode's calls trained on is exactly what the
model sampled with the chat template's rendering of the agent's new messages between, checked
here from the template's own definition (the embedded template writes a message's content as it
is and closes an assistant message with eos), not by the capture's code."""

import asyncio
import json

import openai
import pytest
import torch
from hf_checkpoints import tiny_qwen3_config
from transformers import AutoModelForCausalLM

from forge.agents.openai_api import AgentSampling, reply_message
from forge.agents.server import AgentEndpoint
from forge.data.chat_prompts import PromptRenderer
from forge.data.tokenizer import embedded_tokenizer
from forge.data.types import Completion
from forge.engines.generation import SamplingParams, to_completions
from forge.engines.hf_generate import HFGenerateEngine
from forge.envs.turns import TurnRenderer

TOKENIZER = embedded_tokenizer()
EOS = TOKENIZER.eos_token_id
TEMPERATURE = 0.9
ALLOWED = AgentSampling(temperature=TEMPERATURE, max_tokens=6, max_n=4)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("agent_model")
    AutoModelForCausalLM.from_config(
        tiny_qwen3_config(len(TOKENIZER), EOS), dtype=torch.float32
    ).save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return HFGenerateEngine(model, eos_token_id=EOS, tokenizer=TOKENIZER)


class EngineGenerate:
    """The rollouts' generate call over the engine, one call at a time; remembers every sample
    by the prompt it continued, and the sampling each call asked for."""

    def __init__(self, engine):
        self.engine, self.sampled, self.asked = engine, {}, []
        self.lock = asyncio.Lock()

    async def __call__(self, prompt_ids, sample_keys, n, max_tokens, **sampling):
        self.asked.append({"n": n, "max_tokens": max_tokens, **sampling})
        params = SamplingParams(n=n, max_tokens=max_tokens, seed=0, **sampling)
        async with self.lock:
            outputs = await asyncio.to_thread(self.engine.generate, prompt_ids, params, sample_keys)
        for ids, group in zip(prompt_ids, outputs, strict=True):
            self.sampled.setdefault(tuple(ids), []).extend(group)
        return to_completions([""] * len(prompt_ids), prompt_ids, outputs, TOKENIZER, 3)


def serve(engine, agent, max_sequence_tokens=64, max_calls=4):
    """Runs `agent(endpoint, generate)` against a started endpoint; its result."""

    async def main():
        generate = EngineGenerate(engine)
        renderer = TurnRenderer(PromptRenderer(TOKENIZER, "auto"))
        endpoint = AgentEndpoint(renderer, max_sequence_tokens=max_sequence_tokens, max_calls=max_calls)
        await endpoint.start()
        try:
            return await agent(endpoint, generate)
        finally:
            await endpoint.stop()

    return asyncio.run(main())


def client(episode):
    return openai.AsyncOpenAI(base_url=episode.base_url, api_key="unused", max_retries=0)


def sampled_ids(generate, prompt_ids):
    [sample] = generate.sampled[tuple(prompt_ids)]
    return sample.token_ids


def closing(ids):
    """What the template puts after an assistant message: eos, unless the model sampled it."""
    return [] if ids[-1] == EOS else [EOS]


def test_a_three_call_episode_trains_the_sampled_tokens_and_the_rendered_messages(engine):
    async def agent(endpoint, generate):
        episode = endpoint.open(7, generate, ALLOWED)
        messages = [{"role": "user", "content": "12+30="}]
        # Tools declared at every call (the embedded template does not render them; a call in
        # the model's text would be parsed).
        tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
        replies = []
        for follow_up in ("try again:", "last:"):
            answer = await client(episode).chat.completions.create(
                model="policy", messages=messages, tools=tools
            )
            replies.append(answer.choices[0].message.content)
            messages += [
                {"role": "assistant", "content": replies[-1]},
                {"role": "user", "content": follow_up},
            ]
        answer = await client(episode).chat.completions.create(
            model="policy", messages=messages, logprobs=True, tools=tools, tool_choice="auto"
        )
        replies.append(answer.choices[0].message.content)
        return endpoint.close(episode), generate, answer, replies

    capture, generate, last_answer, replies = serve(engine, agent)
    [sequence] = capture.sequences()
    assert capture.calls == 3 and capture.splits == 0

    # Independently: the first prompt as the template renders it, then each sample's ids as
    # sampled, each follow-up's content after the assistant message's closing.
    expected = TOKENIZER.apply_chat_template(
        [{"role": "user", "content": "12+30="}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    mask = []
    for follow_up in ("try again:", "last:", None):
        sample = sampled_ids(generate, expected)
        expected = expected + sample
        mask += [1] * len(sample)
        if follow_up is not None:
            inserted = closing(sample) + TOKENIZER.encode(follow_up, add_special_tokens=False)
            expected = expected + inserted
            mask += [0] * len(inserted)
    assert sequence.ids == expected
    assert sequence.mask == mask
    assert [t.role for t in sequence.turns] == ["assistant", "user", "assistant", "user", "assistant"]
    # Each reply was the sample's text; the last answer's logprobs are the engine's.
    last = generate.sampled[tuple(sequence.ids[: len(sequence.ids) - sequence.turns[-1].num_tokens])][0]
    assert replies[-1] == TOKENIZER.decode(last.token_ids, skip_special_tokens=True)
    assert [e.logprob for e in last_answer.choices[0].logprobs.content] == pytest.approx(last.logprobs, abs=0)
    # Every call sampled at the run's temperature, up to its token limit.
    assert all(
        a["temperature"] == TEMPERATURE and a["max_tokens"] == ALLOWED.max_tokens for a in generate.asked
    )


def test_an_agent_that_rewrites_its_history_gets_exact_split_sequences(engine):
    async def agent(endpoint, generate):
        episode = endpoint.open(3, generate, ALLOWED)
        first = [{"role": "user", "content": "7+8="}]
        answer = await client(episode).chat.completions.create(model="policy", messages=first)
        # The agent summarises instead of sending the conversation back.
        second = [{"role": "user", "content": "summary: 7+8"}, {"role": "user", "content": "answer:"}]
        await client(episode).chat.completions.create(model="policy", messages=second)
        return endpoint.close(episode), generate, first, second, answer

    capture, generate, first, second, answer = serve(engine, agent)
    assert capture.calls == 2 and capture.splits == 1
    sequences = capture.sequences()
    assert len(sequences) == 2
    for sequence, messages in zip(sequences, (first, second), strict=True):
        prompt = TOKENIZER.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert sequence.ids == prompt + sampled_ids(generate, prompt)
        assert sequence.mask == [1] * (len(sequence.ids) - len(prompt))
    assert answer.choices[0].message.content == sequences[0].last_model_text


def test_n_samples_fork_the_sequence_and_the_one_continued_grows(engine):
    async def agent(endpoint, generate):
        episode = endpoint.open(5, generate, ALLOWED)
        messages = [{"role": "user", "content": "2+2="}]
        answer = await client(episode).chat.completions.create(model="policy", messages=messages, n=3)
        chosen = answer.choices[1].message.content
        messages += [{"role": "assistant", "content": chosen}, {"role": "user", "content": "sure?"}]
        await client(episode).chat.completions.create(model="policy", messages=messages)
        return endpoint.close(episode), answer

    capture, answer = serve(engine, agent)
    sequences = capture.sequences()
    # Choices 0 and 2 end their own sequences; choice 1's goes on with the follow-up.
    assert len(sequences) == 3 and capture.splits == 0
    texts = [c.message.content for c in answer.choices]
    assert [s.last_model_text for s in sequences[:2]] == [texts[0], texts[2]]
    assert [t.role for t in sequences[2].turns] == ["assistant", "user", "assistant"]


def test_32_episodes_at_once_each_trains_only_its_own_calls(engine):
    async def agent(endpoint, generate):
        async def one(i):
            episode = endpoint.open(i, generate, ALLOWED)
            messages = [{"role": "user", "content": f"{i}+{i}="}]
            answer = await client(episode).chat.completions.create(model="policy", messages=messages)
            messages += [{"role": "assistant", "content": answer.choices[0].message.content}]
            messages += [{"role": "user", "content": "again:"}]
            await client(episode).chat.completions.create(model="policy", messages=messages)
            return endpoint.close(episode)

        return await asyncio.gather(*(one(i) for i in range(32)))

    captures = serve(engine, agent)
    for i, capture in enumerate(captures):
        [sequence] = capture.sequences()
        own = TOKENIZER.apply_chat_template(
            [{"role": "user", "content": f"{i}+{i}="}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        assert sequence.ids[: len(own)] == own
        assert [t.role for t in sequence.turns] == ["assistant", "user", "assistant"]


@pytest.mark.parametrize(
    "settings, param",
    [
        ({"temperature": 0.3}, "temperature"),
        ({"top_p": 0.9}, "top_p"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"max_tokens": 7}, "max_tokens"),
        ({"n": 5}, "n"),
        (
            {"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "calc"}}]},
            "tool_choice",
        ),
    ],
)
def test_settings_that_would_bias_training_are_refused_with_a_clear_error(engine, settings, param):
    async def agent(endpoint, generate):
        episode = endpoint.open(1, generate, ALLOWED)
        with pytest.raises(openai.BadRequestError) as refused:
            await client(episode).chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "1+1="}], **settings
            )
        # The run's own setting is served.
        await client(episode).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "1+1="}], temperature=TEMPERATURE
        )
        return refused.value, generate

    refused, generate = serve(engine, agent)
    assert refused.body["param"] == param and param in refused.body["message"]
    assert len(generate.asked) == 1  # nothing was sampled for the refused call


def test_a_call_samples_within_the_sequence_budget_and_past_it_or_max_calls_is_refused(engine):
    async def agent(endpoint, generate):
        episode = endpoint.open(1, generate, ALLOWED)
        messages = [{"role": "user", "content": "123456789="}]  # 11 tokens of the 14
        answer = await client(episode).chat.completions.create(model="policy", messages=messages)
        refusals = []
        messages += [{"role": "assistant", "content": answer.choices[0].message.content}]
        messages += [{"role": "user", "content": "more:"}]
        with pytest.raises(openai.BadRequestError) as full:
            await client(episode).chat.completions.create(model="policy", messages=messages)
        refusals.append(full.value.body)
        other = endpoint.open(2, generate, ALLOWED)
        for _ in range(2):
            await client(other).chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "1="}]
            )
        with pytest.raises(openai.BadRequestError) as calls:
            await client(other).chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "1="}]
            )
        refusals.append(calls.value.body)
        return generate, refusals

    generate, (full, calls) = serve(engine, agent, max_sequence_tokens=14, max_calls=2)
    assert generate.asked[0]["max_tokens"] == 3  # 14 - 11: cut from the 6 allowed
    assert full["code"] == "context_length_exceeded" and "seq_len" in full["message"]
    assert calls["code"] == "max_calls" and "agent.max_calls" in calls["message"]


def test_models_are_listed_and_an_ended_episode_is_refused(engine):
    async def agent(endpoint, generate):
        episode = endpoint.open(1, generate, ALLOWED)
        models = await client(episode).models.list()
        endpoint.close(episode)
        with pytest.raises(openai.NotFoundError, match="no such episode"):
            await client(episode).chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "1"}]
            )
        return [m.id for m in models.data]

    assert serve(engine, agent) == ["policy"]


def test_a_sampled_tool_call_becomes_the_replys_tool_calls():
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    text = 'let me compute\n<tool_call>\n{"name": "calc", "arguments": {"expression": "1+2"}}\n</tool_call>'
    sample = Completion("", [1], [5, 6], [-0.1, -0.2], text, "stop", 0)
    message, finish = reply_message(sample, tools)
    assert finish == "tool_calls" and message["content"] == "let me compute"
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "calc" and json.loads(call["function"]["arguments"]) == {
        "expression": "1+2"
    }
    # An unknown tool stays text; without tools the text is the reply.
    assert reply_message(sample, [{"type": "function", "function": {"name": "other"}}]) == (
        {"role": "assistant", "content": text},
        "stop",
    )


def test_the_anthropic_client_converses_with_tool_results_and_is_refused_top_k(engine):
    anthropic = pytest.importorskip("anthropic")

    async def agent(endpoint, generate):
        episode = endpoint.open(11, generate, ALLOWED)
        client = anthropic.AsyncAnthropic(
            base_url=episode.base_url.removesuffix("/v1"), api_key="unused", max_retries=0
        )
        tools = [{"name": "calc", "description": "adds", "input_schema": {"type": "object"}}]
        messages = [{"role": "user", "content": "3+4="}]
        first = await client.messages.create(model="policy", max_tokens=6, messages=messages, tools=tools)
        # The agent answers with a tool result block, as Anthropic's tool loop does.
        messages += [
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "7"}]},
        ]
        second = await client.messages.create(model="policy", max_tokens=6, messages=messages, tools=tools)
        with pytest.raises(anthropic.BadRequestError, match="top_k"):
            await client.messages.create(
                model="policy", max_tokens=6, messages=messages, extra_body={"top_k": 5}
            )
        return endpoint.close(episode), first, second

    capture, first, second = serve(engine, agent)
    [sequence] = capture.sequences()
    assert capture.splits == 0 and [t.role for t in sequence.turns] == ["assistant", "tool", "assistant"]
    assert first.stop_reason in ("end_turn", "max_tokens") and first.content[0].type == "text"
    # The tool result is rendered after the model's turn (eos unless sampled, then its content).
    model_turn = sequence.turns[0].num_tokens
    tool = sequence.response_ids[model_turn : model_turn + sequence.turns[1].num_tokens]
    sampled = sequence.response_ids[:model_turn]
    assert tool == closing(sampled) + TOKENIZER.encode("7", add_special_tokens=False)
    assert second.usage.input_tokens == len(sequence.prompt.ids) + model_turn + len(tool)


def test_anthropic_tool_use_round_trips_as_the_same_conversation():
    from forge.agents.anthropic_api import message_response, parse_messages_request
    from forge.agents.capture import message_key

    tools = [{"name": "calc", "input_schema": {"type": "object"}}]
    text = 'ok<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>'
    sample = Completion("", [1], [5, 6], [-0.1, -0.2], text, "stop", 0)
    declared = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    reply = reply_message(sample, declared)
    message = message_response("policy", [1], sample, reply, [])
    assert message["stop_reason"] == "tool_use"
    assert [b["type"] for b in message["content"]] == ["text", "tool_use"] and message["content"][1][
        "input"
    ] == {"x": 1}
    # Sent back by the agent, the assistant's blocks are the reply the capture recorded.
    body = {
        "max_tokens": 4,
        "system": "be brief",
        "tools": tools,
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": message["content"]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "x", "content": [{"type": "text", "text": "2"}]}
                ],
            },
        ],
    }
    chat = parse_messages_request(body, ALLOWED)
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert message_key(chat.messages[2]) == message_key(reply[0])
    assert chat.messages[3]["content"] == "2" and chat.tools == declared


def test_text_completions_continue_a_sequence_by_its_text_and_split_when_it_changes(engine):
    async def agent(endpoint, generate):
        episode = endpoint.open(13, generate, ALLOWED)
        first = await client(episode).completions.create(model="policy", prompt="5+5=", logprobs=0)
        text = "5+5=" + first.choices[0].text + " so:"
        await client(episode).completions.create(model="policy", prompt=text)
        await client(episode).completions.create(model="policy", prompt="other")
        return endpoint.close(episode), generate, first

    capture, generate, first = serve(engine, agent)
    assert capture.calls == 3 and capture.splits == 1
    continued, other = capture.sequences()
    prompt = TOKENIZER("5+5=").input_ids
    sample = sampled_ids(generate, prompt)
    inserted = TOKENIZER.encode(" so:", add_special_tokens=False)
    second = sampled_ids(generate, prompt + sample + inserted)
    assert continued.ids == prompt + sample + inserted + second
    assert continued.mask == [1] * len(sample) + [0] * len(inserted) + [1] * len(second)
    assert other.ids[: len(TOKENIZER("other").input_ids)] == TOKENIZER("other").input_ids
    assert first.choices[0].logprobs.token_logprobs == pytest.approx(
        generate.sampled[tuple(prompt)][0].logprobs, abs=0
    )
