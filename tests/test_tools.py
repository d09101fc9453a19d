"""Tools for multi-turn rollouts (multiturn/tools.py): described from signature and docstring,
called from the model's text, every bad call an error message and a kind, never a raise."""

import time

import pytest

from grpo_cli.config import ConfigError
from grpo_cli.multiturn import tools as tools_module
from grpo_cli.multiturn.builtin_tools import calculator
from grpo_cli.multiturn.tools import (
    BAD_ARGUMENTS,
    MALFORMED,
    RAISED,
    TIMEOUT,
    UNKNOWN_TOOL,
    ToolCall,
    build_tools,
    parse_tool_calls,
    run_tool_call,
)


def scaled_sum(a: int, b: int, scale: int = 1) -> int:
    """Add two numbers and scale the sum.

    Args:
        a: The first number.
        b: The second number.
        scale: What the sum is multiplied by.
    """
    return (a + b) * scale


def hangs(seconds: float) -> str:
    """Wait.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def no_docstring(x: int) -> int:
    return x


def tool_entry(function, **fixed):
    return {"_target_": f"{__name__}.{function.__name__}", **fixed}


def test_a_tool_is_described_from_its_signature_and_docstring_without_its_fixed_arguments():
    (tool,) = build_tools([tool_entry(scaled_sum, scale=10)])
    function = tool.schema["function"]
    assert tool.schema["type"] == "function" and function["name"] == "scaled_sum"
    assert function["description"] == "Add two numbers and scale the sum."
    assert set(function["parameters"]["properties"]) == {"a", "b"}  # scale is fixed by the config
    assert function["parameters"]["required"] == ["a", "b"]
    assert function["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first number."}
    assert tool.fn(a=1, b=2) == 30


def test_bad_tool_entries_name_the_entry_and_say_what_to_do():
    with pytest.raises(ConfigError, match=r"rollout.tools\[0\]._target_=.*no_docstring.*docstring"):
        build_tools([tool_entry(no_docstring)])
    with pytest.raises(ConfigError, match=r"rollout.tools\[0\]._target_=nowhere.tool: cannot import"):
        build_tools([{"_target_": "nowhere.tool"}])
    with pytest.raises(ConfigError, match=r"rollout.tools\[0\] has no _target_"):
        build_tools([{"name": "x"}])
    with pytest.raises(ConfigError, match=r"rollout.tools\[0\].*sets \['rate'\]"):
        build_tools([tool_entry(scaled_sum, rate=2)])
    with pytest.raises(ConfigError, match=r"rollout.tools\[1\]: a second tool named 'scaled_sum'"):
        build_tools([tool_entry(scaled_sum), tool_entry(scaled_sum)])
    assert [tool.name for tool in build_tools([tool_entry(scaled_sum), tool_entry(scaled_sum, name="other")])] == [
        "scaled_sum",
        "other",
    ]


def test_calls_are_read_from_the_hermes_format_in_order():
    text = (
        "Let me add.\n<tool_call>\n"
        '{"name": "scaled_sum", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
    )
    assert parse_tool_calls(text) == [
        ToolCall("scaled_sum", {"a": 2, "b": 3}),
        ToolCall("calculator", {"expression": "1+1"}),  # arguments as a JSON string, as some templates write
    ]
    assert parse_tool_calls("The answer is 5.") == []


@pytest.mark.parametrize(
    "text, why",
    [
        ('<tool_call>{"name": "scaled_sum", "arguments": {"a": 2,</tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "scaled_sum", "arguments": {"a": 2}', "not valid JSON"),  # never closed
        ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
        ('<tool_call>{"name": "scaled_sum", "arguments": [1]}</tool_call>', '"arguments" of scaled_sum'),
    ],
)
def test_a_malformed_call_is_an_error_message_to_the_model(text, why):
    (call,) = parse_tool_calls(text)
    assert why in call.error
    result = run_tool_call(call, build_tools([tool_entry(scaled_sum)]), timeout_s=1, max_chars=100)
    assert result.error_kind == MALFORMED and result.content.startswith("Error: ") and why in result.content


def test_each_bad_call_becomes_an_error_of_its_kind_and_a_good_one_its_value():
    tools = build_tools([tool_entry(scaled_sum), {"_target_": "grpo_cli.multiturn.builtin_tools.calculator"}])

    def run(name, **arguments):
        return run_tool_call(ToolCall(name, arguments), tools, timeout_s=2, max_chars=40)

    assert (run("scaled_sum", a=2, b=3).content, run("scaled_sum", a=2, b=3).error_kind) == ("5", None)
    unknown = run("search", query="x")
    assert unknown.error_kind == UNKNOWN_TOOL and "calculator, scaled_sum" in unknown.content
    assert run("scaled_sum", a=2).error_kind == BAD_ARGUMENTS
    assert run("scaled_sum", a=2, b=3, c=4).error_kind == BAD_ARGUMENTS
    raised = run("calculator", expression="1 / 0")
    assert raised.error_kind == RAISED and "ZeroDivisionError" in raised.content
    assert run("calculator", expression="__import__('os')").error_kind == RAISED
    long = run("calculator", expression="7 ** 99")
    assert long.error_kind is None and long.content.startswith(str(7**99)[:40]) and "characters cut" in long.content


def test_a_tool_that_hangs_is_cut_off_at_its_timeout():
    tools = build_tools([tool_entry(hangs)])
    started = time.monotonic()
    result = run_tool_call(ToolCall("hangs", {"seconds": 30}), tools, timeout_s=0.5, max_chars=100)
    assert result.error_kind == TIMEOUT and "0.5 s" in result.content
    assert time.monotonic() - started < 5
    assert run_tool_call(ToolCall("hangs", {"seconds": 0}), tools, timeout_s=0.5, max_chars=100).content == "woke"


def test_calculator_does_arithmetic_and_nothing_else():
    assert calculator("37 + 48") == "85"
    assert calculator("(2 + 3) * 4 - 6 / 3") == "18"
    assert calculator("7 / 2") == "3.5"
    assert calculator("-2 ** 3") == "-8"
    for bad in ["x + 1", "open('f')", "2 ** 1000", "'a' * 3"]:
        with pytest.raises((ValueError, SyntaxError)):
            calculator(bad)


def test_a_template_with_a_response_schema_is_parsed_by_transformers(monkeypatch):
    class Templated:
        response_schema = {"type": "object"}

        def parse_response(self, text):
            return {
                "role": "assistant",
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
            }

    assert parse_tool_calls("anything", Templated()) == [ToolCall("f", {"x": 1})]

    class Broken(Templated):
        def parse_response(self, text):
            raise ValueError("no match")

    (call,) = parse_tool_calls("anything", Broken())
    assert call.error and "no match" in call.error
    assert tools_module.parse_tool_calls("<tool_call>{}</tool_call>", object()) != []  # no schema: Hermes
