"""Agent programs for the agent endpoint's app tests (`agent.function: agent_programs:...`): plain
`openai` client loops, as a user would write them."""

import asyncio

RESULT = "<result>7</result>"


async def two_calls(client, model: str, row: dict) -> str:
    """Asks, answers the reply with a tool message, asks again: the last reply."""
    messages = [{"role": "user", "content": row["prompt"]}]
    reply = await client.chat.completions.create(model=model, messages=messages)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
    messages += [{"role": "tool", "content": RESULT}]
    reply = await client.chat.completions.create(model=model, messages=messages)
    return reply.choices[0].message.content


def reward_of(answer: str) -> float:
    """The working agent's reward: a function of what was sampled, so groups differ."""
    return float(sum(map(ord, answer)) % 3)


async def misbehaving(client, model: str, row: dict):
    """By the row's index: raises, hangs, never calls, returns no number, or works (`reward_of`)."""
    kind = row["index"] % 6
    if kind == 0:
        raise RuntimeError("the agent's own bug")
    if kind == 1:
        await asyncio.sleep(3600)
    if kind == 2:
        return 1.0  # without a call: nothing to train
    answer = await two_calls(client, model, row)
    return "done" if kind == 3 else reward_of(answer)
