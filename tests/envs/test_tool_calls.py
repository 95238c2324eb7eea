"""Tool calls parsed from model text, and the built-in tools: calc's arithmetic and refusals, the
python tool running real code in the sandbox."""

import asyncio
import random
from fractions import Fraction

import pytest

from forge.data.tokenizer import EMBEDDED_ALPHABET
from forge.envs.sandbox import SandboxResult, SandboxUnavailableError
from forge.envs.tool_calls import ToolCall, parse_tool_calls, tool_result_message
from forge.envs.tools import CalcTool, PythonTool, describe_python_result, evaluate_arithmetic

NAMES = ["calc", "python"]


def test_tag_calls_are_found_in_order_with_their_arguments_verbatim():
    text = "first <calc>12+34+5</calc> then<python>x = 2\nprint(x * 3)</python><calc> 1 </calc>"
    assert parse_tool_calls(text, "tag", NAMES) == [
        ToolCall("calc", "12+34+5"),
        ToolCall("python", "x = 2\nprint(x * 3)"),
        ToolCall("calc", " 1 "),
    ]


def test_adjacent_tags_are_separate_calls():
    text = "<calc>1+2</calc><calc>3*4</calc>"
    assert parse_tool_calls(text, "tag", NAMES) == [ToolCall("calc", "1+2"), ToolCall("calc", "3*4")]


def test_a_tag_inside_another_calls_argument_belongs_to_that_argument():
    text = "<python>print('<calc>1+1</calc>')</python>"
    assert parse_tool_calls(text, "tag", NAMES) == [ToolCall("python", "print('<calc>1+1</calc>')")]


def test_unregistered_unclosed_and_mismatched_tags_are_not_calls():
    assert parse_tool_calls("the answer is <answer>46</answer>", "tag", NAMES) == []
    assert parse_tool_calls("<calc>1+2", "tag", NAMES) == []
    assert parse_tool_calls("<calc>1+2</python>", "tag", NAMES) == []
    assert parse_tool_calls("<calc>1+2</calc>", "tag", ["python"]) == []
    assert parse_tool_calls("<calc>1+2</calc>", "tag", []) == []
    assert parse_tool_calls("no calls here", "tag", NAMES) == []


def test_json_calls_are_decoded_several_per_turn():
    text = (
        "I will compute both.\n"
        '<tool_call>\n{"name": "calc", "arguments": {"expression": "1+2"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "python", "arguments": {"code": "print(\'<tool_call>\')"}}\n</tool_call>'
    )
    assert parse_tool_calls(text, "json", NAMES) == [
        ToolCall("calc", {"expression": "1+2"}),
        ToolCall("python", {"code": "print('<tool_call>')"}),
    ]


def test_malformed_json_calls_are_invalid_calls_with_a_reason():
    bodies = {
        '{"name": "calc", "arguments": {"expression": "1+2"}': "not valid JSON",
        '["calc"]': 'JSON object with a "name"',
        '{"arguments": {}}': 'JSON object with a "name"',
        '{"name": "calc", "arguments": "1+2"}': "must be a JSON object",
        '{"name": "search", "arguments": {"q": "x"}}': "unknown tool 'search': the tools are calc, python",
    }
    text = "".join(f"<tool_call>\n{body}\n</tool_call>" for body in bodies)
    calls = parse_tool_calls(text, "json", NAMES)
    assert len(calls) == len(bodies)
    for call, (body, reason) in zip(calls, bodies.items(), strict=True):
        assert call.error is not None and reason in call.error
        assert call.arguments == f"\n{body}\n"


def test_json_format_ignores_tags_and_text_without_calls():
    assert parse_tool_calls("<calc>1+2</calc> and plain text", "json", NAMES) == []


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown tool call format 'xml'"):
        parse_tool_calls("<calc>1</calc>", "xml", NAMES)


def test_results_are_tool_messages_tagged_only_in_the_tag_format():
    assert tool_result_message("46", "tag") == {"role": "tool", "content": "<result>46</result>"}
    assert tool_result_message("46", "tag", "out") == {"role": "tool", "content": "<out>46</out>"}
    assert tool_result_message("46", "json") == {"role": "tool", "content": "46"}


@pytest.mark.parametrize(
    "expression, value",
    [
        ("12+34+5", "51"),
        ("(2+3)*4-10/4", "17.5"),
        ("-(3-5)*-2", "-4"),
        ("0.1+0.2", "0.3"),  # exact, where floats give 0.30000000000000004
        ("1/3", "0.333333333333333"),
        ("2/3", "0.666666666666667"),
        ("7/7", "1"),
        ("2.50*4", "10"),
        ("012+34+005", "51"),  # leading zeros, which Python's parser refuses
        ("0.05+100", "100.05"),
        (" 5. + .5 ", "5.5"),
        ("123456789012345678901234567890*10", "1234567890123456789012345678900"),
    ],
)
def test_calc_computes_exact_values(expression, value):
    assert evaluate_arithmetic(expression) == value


def test_calc_agrees_with_exact_fractions_on_random_expressions():
    rng = random.Random(0)
    for _ in range(200):
        numbers = [rng.randint(-50, 50) for _ in range(5)]
        operators = [rng.choice("+-*/") for _ in range(4)]
        expression = str(numbers[0]) + "".join(
            f"{op}({n})" for op, n in zip(operators, numbers[1:], strict=True)
        )
        oracle = (
            "Fraction("
            + str(numbers[0])
            + ")"
            + "".join(f"{op}Fraction({n})" for op, n in zip(operators, numbers[1:], strict=True))
        )
        try:
            expected = eval(oracle, {"Fraction": Fraction})
        except ZeroDivisionError:
            assert evaluate_arithmetic_error(expression) == "division by zero"
            continue
        assert abs(Fraction(evaluate_arithmetic(expression)) - expected) <= abs(expected) * Fraction(
            1, 10**14
        )
        if expected.denominator == 1:
            assert evaluate_arithmetic(expression) == str(expected)


def evaluate_arithmetic_error(expression: str) -> str:
    result = asyncio.run(CalcTool()(expression))
    assert result.startswith("error: "), f"{expression} gave {result}"
    return result.removeprefix("error: ")


@pytest.mark.parametrize(
    "expression, reason",
    [
        ("x+1", "names are not allowed"),
        ("abs(-1)", "function calls are not allowed"),
        ("__import__('os').system('echo hi')", "function calls are not allowed"),
        ("(1).real", "attributes are not allowed"),
        ("2**10", "not allowed: use numbers"),
        ("9**9**9", "not allowed: use numbers"),
        ("7//2", "not allowed: use numbers"),
        ("'a'*3", "not allowed: use numbers"),
        ("[1, 2]", "not allowed: use numbers"),
        ("1 if 1 else 2", "not allowed: use numbers"),
        ("True+1", "not allowed: use numbers"),
        ("1j*1j", "not allowed: use numbers"),
        ("1e5", "not a plain number"),
        ("0x10", "not a plain number"),
        ("1_000", "not a plain number"),
        ("9" * 41, "more than 40 digits"),
        ("99999999999999999999*99999999999999999999*99", "more than 40 digits"),
        ("1" + "/3" * 90, "more than 40 digits"),  # too precise: the denominator grows
        ("1/0", "division by zero"),
        ("5/(2-2)", "division by zero"),
        ("", "empty expression"),
        ("1+", "not an arithmetic expression"),
        ("1;2", "not an arithmetic expression"),
        ("1" + "+1" * 200, "longer than 400 characters"),
    ],
)
def test_calc_refuses_anything_but_bounded_arithmetic(expression, reason):
    error = evaluate_arithmetic_error(expression)
    assert reason in error
    # The tag format's character-level tokenizer can read every refusal of plain input.
    if expression.isascii() and "'" not in expression and "_" not in expression:
        assert set(error) <= set(EMBEDDED_ALPHABET), error


def test_calc_takes_its_json_argument_by_name_only():
    calc = CalcTool()
    assert asyncio.run(calc({"expression": "6*7"})) == "42"
    for arguments in ({"expr": "6*7"}, {"expression": 42}, {"expression": "6*7", "x": "1"}, {}):
        assert asyncio.run(calc(arguments)) == "error: calc takes one string argument, expression"


def run_python_tool(code: str, **settings) -> str:
    try:
        return asyncio.run(PythonTool(**settings)(code))
    except SandboxUnavailableError as e:
        pytest.skip(f"the python tool's sandbox cannot run on this machine: {e}")


def test_python_tool_returns_what_the_code_printed():
    assert run_python_tool("print(sum(range(10)))") == "45"
    assert run_python_tool({"code": "import math\nprint(math.factorial(20))"}) == str(2432902008176640000)
    assert run_python_tool("x = 1") == "(no output)"


def test_python_tool_reports_a_failure_with_the_traceback_tail():
    answer = run_python_tool("import sys\nprint('before')\nsys.stderr.write('w' * 3000 + '\\n')\n1/0")
    lines = answer.split("\n")
    assert lines[0] == "before" and lines[-1] == "(exit code 1)"
    # Only the end of stderr comes back, and the end is what says what went wrong.
    assert "ZeroDivisionError: division by zero" in answer and 0 < answer.count("w") < 500


def test_python_tool_cannot_reach_the_network_and_says_so():
    code = "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\nprint('escaped')\n"
    answer = run_python_tool(code)
    assert "escaped" not in answer and "OSError" in answer and answer.endswith("(exit code 1)")


def test_python_tool_limits_come_from_its_settings():
    assert run_python_tool("while True: pass", wall_s=1.0) == "(timed out)"
    answer = run_python_tool("print('x' * 5000)", max_output_chars=100)
    assert answer == "x" * 100 + "\n... (4900 more characters)"


def test_python_tool_refuses_unknown_settings():
    with pytest.raises(ValueError, match=r"unknown settings \['wall'\].*max_output_chars, cpu_s"):
        PythonTool(wall="1")


def test_a_run_stopped_for_printing_too_much_says_so():
    result = SandboxResult("a" * 10, "b" * 600, exit_code=None, timed_out=False, output_truncated=True)
    answer = describe_python_result(result, max_output_chars=4)
    assert answer == "aaaa\n... (6 more characters)\n..." + "b" * 500 + "\n(stopped: it printed too much)"
