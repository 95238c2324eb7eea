"""A calculator agent written only against the OpenAI API, as an agent program people already
have would be: its own loop calls the model, runs the calculator itself when the model writes
`<calc>171+19+458</calc>`, and gives the result back as a tool message, `<result>648</result>`.
The model's first turn without a call is the answer; the run's reward functions score it.

forge trains it with `agent.function: examples.calc_agent.agent:solve`
(configs/grpo/agent_cpu.yaml, `make grpo-agent`).
"""

import ast
import operator
import re

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
OPERATIONS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
MAX_TURNS = 3  # a call, then the answer; a third turn lets a model that calls twice still answer


async def solve(client, model: str, row: dict) -> None:
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model=model, messages=messages, stop=["</calc>"])
        text = reply.choices[0].message.content
        messages.append({"role": "assistant", "content": text})
        call = CALL.search(text)
        if call is None:
            return None  # the answer: the run's reward functions score it
        messages.append({"role": "tool", "content": f"<result>{calculate(call[1])}</result>"})
    return None


def calculate(expression: str) -> str:
    """Integer arithmetic with + - * only; anything else is an error message for the model."""
    try:
        return str(_value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError):
        return "error"


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATIONS:
        return OPERATIONS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError(f"not integer arithmetic: {ast.dump(node)}")
