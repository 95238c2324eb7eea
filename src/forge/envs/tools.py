"""The tools a ``ToolEnvironment`` offers: built-in ones (``BUILTIN_TOOLS``) and the user's own.

A tool takes one string argument (named ``parameter`` in its JSON schema), whole in the tag format
(``<calc>1+2</calc>``) or as ``{"expression": "1+2"}`` in the json format, and answers with text.
What the model did wrong (a bad expression, code that fails) is answered as text, ``error: ...``,
so that the episode goes on and the model can learn from it.

- ``calc``: integers and decimals with ``+ - * /``, parentheses and unary minus, computed exactly
  (fractions), by walking the syntax tree: nothing is evaluated as Python code.
- ``python``: runs the code in ``forge.envs.sandbox`` and returns what it printed, with a note
  when it failed, timed out or printed too much. If the machine cannot run the sandbox,
  ``SandboxUnavailableError`` propagates: that is the run's set-up, not the model, failing.

A tool of your own is named by import path, ``"package.module:name"``: a function (sync or async)
taking the argument string and returning the answer (its docstring's first paragraph describes
it to the model), or a ``Tool`` subclass or instance for another schema. Raising ``ToolError``
answers the model with its message; any other exception is a bug and fails the trajectory.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import importlib
import inspect
import operator
import re
from collections.abc import Callable
from decimal import Decimal, localcontext
from fractions import Fraction
from typing import Any

from forge.envs.sandbox import SandboxLimits, SandboxResult, run_python


class ToolError(Exception):
    """Raised by a tool to answer the model with ``error: <message>``."""


class Tool:
    """A tool of one string argument: subclasses set the class attributes and implement ``run``."""

    name: str
    description: str
    parameter: str
    parameter_description: str

    @property
    def schema(self) -> dict[str, Any]:
        """The function schema that ``apply_chat_template(tools=...)`` takes."""
        parameters = {
            "type": "object",
            "properties": {self.parameter: {"type": "string", "description": self.parameter_description}},
            "required": [self.parameter],
        }
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": parameters},
        }

    async def __call__(self, arguments: dict[str, Any] | str) -> str:
        """The answer to a call: ``arguments`` is the argument string itself (tag format) or the
        call's decoded arguments (json format)."""
        if isinstance(arguments, dict):
            if list(arguments) != [self.parameter] or not isinstance(arguments[self.parameter], str):
                return f"error: {self.name} takes one string argument, {self.parameter}"
            arguments = arguments[self.parameter]
        try:
            return await self.run(arguments)
        except ToolError as e:
            return f"error: {e}"

    async def run(self, argument: str) -> str:
        raise NotImplementedError


# Error messages of calc use only lowercase letters, digits and arithmetic, so that a
# character-level tokenizer of the tag format can read them.
_MAX_EXPRESSION_CHARS = 400  # bounds the syntax tree's depth, which the evaluation recurses over
_MAX_DIGITS = 40  # of any number written or computed: no huge products
_NUMBER = re.compile(r"\d+\.?\d*|\.\d+")  # no exponents, underscores, hex
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_REFUSED = {ast.Name: "names", ast.Call: "function calls", ast.Attribute: "attributes"}
_ALLOWED = "use numbers, + - * / and parentheses"


_LEADING_ZEROS = re.compile(r"(?<![\d.])0+(?=\d)")


def evaluate_arithmetic(expression: str) -> str:
    """The value of ``expression``, as an integer when integral, else a decimal of 15 significant
    digits; raises ``ToolError`` for anything but arithmetic."""
    text = expression.strip()
    if not text:
        raise ToolError(f"empty expression: {_ALLOWED}")
    if len(text) > _MAX_EXPRESSION_CHARS:
        raise ToolError(f"the expression is longer than {_MAX_EXPRESSION_CHARS} characters")
    # Python's parser refuses integers with leading zeros ("012"), which a model may well write.
    text = _LEADING_ZEROS.sub("", text)
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):
        raise ToolError(f"not an arithmetic expression: {_ALLOWED}") from None
    value = _evaluate(tree.body, text)
    if value.denominator == 1:
        return str(value.numerator)
    with localcontext() as context:
        context.prec = 15
        return format(Decimal(value.numerator) / Decimal(value.denominator), "f")


def _evaluate(node: ast.expr, source: str) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        literal = ast.get_source_segment(source, node) or ""
        if not _NUMBER.fullmatch(literal):
            raise ToolError(f"{literal} is not a plain number: write integers or decimals like 12 or 0.5")
        return _bounded(Fraction(literal))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand, source))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, source), _evaluate(node.right, source)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ToolError("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right))
    refused = _REFUSED.get(type(node))
    raise ToolError(f"{refused} are not allowed: {_ALLOWED}" if refused else f"not allowed: {_ALLOWED}")


def _bounded(value: Fraction) -> Fraction:
    if max(abs(value.numerator), value.denominator) >= 10**_MAX_DIGITS:
        raise ToolError(f"a number has more than {_MAX_DIGITS} digits")
    return value


class CalcTool(Tool):
    name = "calc"
    description = "Evaluates an arithmetic expression of integers and decimals with + - * / and parentheses."
    parameter = "expression"
    parameter_description = "the expression, e.g. (12+34)*5/2"

    async def run(self, argument: str) -> str:
        return evaluate_arithmetic(argument)


_STDERR_TAIL_CHARS = 500  # the end of a traceback says what went wrong


class PythonTool(Tool):
    """``max_output_chars`` cuts what the code printed; the other settings are ``SandboxLimits``."""

    name = "python"
    description = "Runs a Python program in a sandbox without network access and returns what it prints."
    parameter = "code"
    parameter_description = "the program; print what you want to see"

    def __init__(self, max_output_chars: int = 2000, **limits: Any):
        known = [field.name for field in dataclasses.fields(SandboxLimits)]
        if unknown := sorted(set(limits) - set(known)):
            raise ValueError(
                f"python tool: unknown settings {unknown}; "
                f"the settings are max_output_chars, {', '.join(known)}"
            )
        self.max_output_chars = max_output_chars
        self.limits = SandboxLimits(**limits)

    async def run(self, argument: str) -> str:
        return describe_python_result(await run_python(argument, self.limits), self.max_output_chars)


def describe_python_result(result: SandboxResult, max_output_chars: int) -> str:
    """What the model reads of a sandbox run: stdout (cut), stderr's tail, and what went wrong."""
    stdout = result.stdout.rstrip("\n")
    if len(stdout) > max_output_chars:
        stdout = f"{stdout[:max_output_chars]}\n... ({len(stdout) - max_output_chars} more characters)"
    stderr = result.stderr.rstrip("\n")
    if len(stderr) > _STDERR_TAIL_CHARS:
        stderr = f"...{stderr[-_STDERR_TAIL_CHARS:]}"
    note = ""
    if result.timed_out:
        note = "(timed out)"
    elif result.output_truncated:
        note = "(stopped: it printed too much)"
    elif result.exit_code:
        note = f"(exit code {result.exit_code})"
    return "\n".join(part for part in (stdout, stderr, note) if part) or "(no output)"


class FunctionTool(Tool):
    """A user's function of the argument string; a sync one runs in a thread, so that it does not
    hold up the other trajectories' event loop."""

    parameter = "input"
    parameter_description = "the input"

    def __init__(self, name: str, function: Callable[[str], Any]):
        self.name, self.function = name, function
        doc = inspect.getdoc(function)
        self.description = doc.split("\n\n")[0] if doc else f"The {name} tool."

    async def run(self, argument: str) -> str:
        # Called in a thread either way: an async function returns its coroutine, awaited here.
        result = await asyncio.to_thread(self.function, argument)
        if inspect.isawaitable(result):
            result = await result
        return str(result)


BUILTIN_TOOLS: dict[str, type[Tool]] = {"calc": CalcTool, "python": PythonTool}


def resolve_tool(spec: str, settings: dict[str, Any] | None = None) -> Tool:
    """The tool ``spec`` names: a built-in tool's name (made with ``settings`` as its keyword
    arguments) or an import path ``"package.module:name"``; raises ``ValueError`` saying what is
    wrong."""
    if spec in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[spec](**(settings or {}))
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"unknown tool '{spec}': the built-in tools are {', '.join(BUILTIN_TOOLS)}; "
            "name a tool of your own by import path, 'package.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"tool '{spec}': cannot import module '{module_name}': {e}") from None
    found = getattr(module, attr, None)
    if isinstance(found, type) and issubclass(found, Tool):
        found = found()
    if isinstance(found, Tool):
        return found
    if callable(found):
        return FunctionTool(attr, found)
    raise ValueError(f"tool '{spec}' must name a function or a Tool, found {found!r}")
