"""ToolEnvironment driven turn by turn as the rollout drives it: tag and json formats, errors the
model makes, tools of the user's own, the sandboxed python tool, and a chat template that
declares the tools."""

import asyncio
import importlib
import json
import string
import textwrap

import pytest

from forge.data.tokenizer import build_char_tokenizer, embedded_tokenizer
from forge.envs.base import EnvStep
from forge.envs.sandbox import SandboxUnavailableError
from forge.envs.tool_env import ToolEnvironment

# ChatML with a tools section in the manner of Qwen2.5's and Hermes' templates (text is written
# by expressions because transformers renders templates with trim_blocks).
TOOLS_CHATML = """
{%- if tools %}
    {{- '<|im_start|>system\\n# Tools\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + tool.function.name + ': ' + tool.function.description + '\\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\nCall a tool as <tool_call>\\n{"name": <name>, "arguments": <object>}\\n</tool_call>' }}
    {{- '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def json_call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def drive(env: ToolEnvironment, row: dict, turns: list[str]) -> tuple[list[dict], list[EnvStep]]:
    """The opening messages and the environment's answer to each model turn."""

    async def episode():
        try:
            opening = await env.reset(row)
            return opening, [await env.step(turn) for turn in turns]
        finally:
            await env.close()

    try:
        return asyncio.run(episode())
    except SandboxUnavailableError as e:
        pytest.skip(f"the python tool's sandbox cannot run on this machine: {e}")


def test_tag_episode_calls_then_answers():
    env = ToolEnvironment()
    opening, (called, answered) = drive(
        env,
        {"prompt": "what is 12+34+5? use <calc>...</calc>", "target": "51"},
        ["i add: <calc>12+34+5</calc>", "the sum is <answer>51</answer>"],
    )
    assert env.tools is None  # the tag format is taught by the prompt, not declared
    assert opening == [{"role": "user", "content": "what is 12+34+5? use <calc>...</calc>"}]
    assert called == EnvStep([{"role": "tool", "content": "<result>51</result>"}], reward=0.0, done=False)
    assert answered == EnvStep([], reward=0.0, done=True)
    # The character-level tokenizer reads every message of the episode without unknown tokens.
    tokenizer = embedded_tokenizer()
    for message in [*opening, *called.messages]:
        assert tokenizer.unk_token_id not in tokenizer(message["content"]).input_ids


def test_chat_messages_open_the_episode_as_they_are():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1?"}]
    opening, _ = drive(ToolEnvironment(), {"prompt": messages}, [])
    assert opening == messages


def test_rows_without_a_usable_prompt_are_refused():
    with pytest.raises(ValueError, match=r"needs a 'prompt' in each row, found the keys \['question'\]"):
        drive(ToolEnvironment(), {"question": "1+1?"}, [])
    with pytest.raises(ValueError, match=r"row\['prompt'\]: the last message is the assistant's"):
        drive(ToolEnvironment(), {"prompt": [{"role": "assistant", "content": "2"}]}, [])


def test_several_calls_of_a_turn_each_get_a_message_in_order_and_the_call_reward():
    env = ToolEnvironment(tools=["calc"], result_tag="out", call_reward=-0.25)
    _, (step,) = drive(env, {"prompt": "go"}, ["<calc>2*3</calc><calc>1/0</calc> and <calc>7-10</calc>"])
    contents = [message["content"] for message in step.messages]
    assert contents == ["<out>6</out>", "<out>error: division by zero</out>", "<out>-3</out>"]
    assert step.reward == pytest.approx(-0.75) and not step.done


def test_calls_past_the_limit_of_a_turn_are_answered_but_not_run_or_rewarded():
    env = ToolEnvironment(max_calls_per_turn=2, call_reward=1.0)
    _, (step,) = drive(env, {"prompt": "go"}, ["<calc>1</calc><calc>2</calc><calc>3</calc>"])
    contents = [message["content"] for message in step.messages]
    assert contents == [
        "<result>1</result>",
        "<result>2</result>",
        "<result>error: not run, only 2 calls are run per turn</result>",
    ]
    assert step.reward == 2.0


def test_json_episode_answers_valid_and_invalid_calls_as_plain_tool_messages():
    env = ToolEnvironment(tools=["calc"], format="json", call_reward=0.5)
    turn = (
        json_call("calc", expression="(1+2)*4")
        + "\n<tool_call>\n{not json}\n</tool_call>"
        + json_call("search", q="x")
    )
    _, (called, answered) = drive(env, {"prompt": "compute"}, [turn, "It is 12."])
    assert [message["role"] for message in called.messages] == ["tool"] * 3
    first, second, third = (message["content"] for message in called.messages)
    assert first == "12"
    assert second.startswith("error: the tool call is not valid JSON")
    assert third == "error: unknown tool 'search': the tools are calc"
    assert called.reward == 0.5 and not called.done
    assert answered.done and answered.messages == []


def test_json_format_declares_the_tools_to_a_chat_template():
    env = ToolEnvironment(tools=["calc", "python"], format="json")
    tokenizer = build_char_tokenizer("".join(dict.fromkeys(string.printable)))
    tokenizer.chat_template = TOOLS_CHATML
    opening, (step,) = drive(env, {"prompt": "What is 6*7?"}, [json_call("calc", expression="6*7")])
    prompt = tokenizer.apply_chat_template(
        opening, tools=env.tools, tokenize=False, add_generation_prompt=True
    )
    declared = prompt.split("<tools>")[1].split("</tools>")[0]
    lines = declared.strip("\n").split("\n")
    assert lines[0].startswith("calc: Evaluates an arithmetic expression") and lines[2].startswith("python: ")
    declared_schemas = [json.loads(line) for line in lines[1::2]]
    assert [schema["function"]["parameters"]["required"] for schema in declared_schemas] == [
        ["expression"],
        ["code"],
    ]
    assert prompt.endswith("<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n")
    conversation = [*opening, {"role": "assistant", "content": "calling"}, *step.messages]
    rendered = tokenizer.apply_chat_template(conversation, tools=env.tools, tokenize=False)
    assert rendered.endswith("<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n")


def test_python_tool_runs_in_the_sandbox_and_an_escape_attempt_does_not_end_the_episode():
    env = ToolEnvironment(tools=["calc", "python"], python={"wall_s": 5.0})
    escape = "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)\nprint('escaped')"
    _, (ran, refused, added, answered) = drive(
        env,
        {"prompt": "go"},
        ["<python>print(sum(range(10)))</python>", f"<python>{escape}</python>", "<calc>45+1</calc>", "46"],
    )
    assert ran.messages == [{"role": "tool", "content": "<result>45</result>"}]
    (message,) = refused.messages
    assert "OSError" in message["content"] and "escaped" not in message["content"]
    assert message["content"].endswith("(exit code 1)</result>") and not refused.done
    assert added.messages == [{"role": "tool", "content": "<result>46</result>"}]
    assert answered.done


@pytest.fixture
def user_tools(tmp_path, monkeypatch):
    """A module of the user's tools, importable by name."""
    (tmp_path / "my_tools.py").write_text(
        textwrap.dedent(
            '''
            import asyncio

            from forge.envs.tools import ToolError

            started = []


            def shout(text):
                """Upper-cases the text.

                More detail the model does not need."""
                return text.upper()


            async def rendezvous(name):
                # Answers only once both calls of the turn have started: they must run together.
                started.append(name)
                while len(started) < 2:
                    await asyncio.sleep(0.01)
                return name


            def picky(text):
                raise ToolError("picky wants nothing")


            def broken(text):
                raise KeyError(text)


            async def sleepy(text):
                await asyncio.sleep(60)


            cancelled = []


            async def stall(text):
                try:
                    await asyncio.sleep(60)
                except asyncio.CancelledError:
                    cancelled.append(text)
                    raise
            '''
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_tools"


def test_user_functions_are_tools_named_after_them(user_tools):
    env = ToolEnvironment(tools=["calc", f"{user_tools}:shout", f"{user_tools}:picky"], format="json")
    names = [schema["function"]["name"] for schema in env.tools]
    assert names == ["calc", "shout", "picky"]
    assert env.tools[1]["function"]["description"] == "Upper-cases the text."
    turn = json_call("shout", input="hi") + json_call("picky", input="x")
    _, (step,) = drive(env, {"prompt": "go"}, [turn])
    assert [message["content"] for message in step.messages] == ["HI", "error: picky wants nothing"]


def test_calls_of_a_turn_run_concurrently(user_tools):
    env = ToolEnvironment(tools=[f"{user_tools}:rendezvous"])

    async def step_with_deadline():
        return await asyncio.wait_for(env.step("<rendezvous>a</rendezvous><rendezvous>b</rendezvous>"), 5)

    step = asyncio.run(step_with_deadline())
    assert [message["content"] for message in step.messages] == ["<result>a</result>", "<result>b</result>"]


def test_a_call_past_its_deadline_is_answered_with_an_error_and_the_others_answer(user_tools):
    env = ToolEnvironment(tools=["calc", f"{user_tools}:sleepy"], call_timeout_s=0.2)
    step = asyncio.run(env.step("<sleepy>waiting</sleepy><calc>1+2</calc>"))
    assert [message["content"] for message in step.messages] == [
        "<result>error: sleepy did not answer within 0.2 s</result>",
        "<result>3</result>",
    ]


def test_a_tool_that_raises_fails_the_step_and_stops_the_other_calls(user_tools):
    env = ToolEnvironment(tools=[f"{user_tools}:stall", f"{user_tools}:broken"])

    async def failing_step():
        with pytest.raises(KeyError, match="oops"):
            await env.step("<stall>waiting</stall><broken>oops</broken>")
        await asyncio.sleep(0.1)  # the cancelled call's clean-up runs
        return list(importlib.import_module(user_tools).cancelled)  # before asyncio.run cancels the rest

    assert asyncio.run(failing_step()) == ["waiting"]


@pytest.mark.parametrize(
    "params, message",
    [
        ({"tools": ["calc", "search"]}, "unknown tool 'search': the built-in tools are calc, python"),
        ({"tools": ["no_such_module:f"]}, "tool 'no_such_module:f': cannot import module 'no_such_module'"),
        ({"tools": ["forge.envs.tools:MISSING"]}, "must name a function or a Tool, found None"),
        ({"tools": ["calc", "calc"]}, "two tools are named 'calc'"),
        ({"tools": "calc"}, "must be a list of tool names, got 'calc'"),
        ({"format": "xml"}, "env.params.format: 'xml' is not one of tag, json"),
        ({"max_calls_per_turn": 0}, "max_calls_per_turn must be at least 1"),
        ({"call_timeout_s": 0}, "call_timeout_s must be positive"),
        ({"python": {"wall_s": 1}}, "'python' is not in env.params.tools"),
        ({"tools": ["python"], "python": {"walls": 1}}, r"unknown settings \['walls'\]"),
    ],
)
def test_bad_params_are_refused_at_construction(params, message):
    with pytest.raises(ValueError, match=message):
        ToolEnvironment(**params)
