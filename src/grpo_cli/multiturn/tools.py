"""Tools the policy may call in a multi-turn rollout (rollout.tools): described to the model from
their signatures and docstrings, called from the model's own text, never raising.

A tool is a Python function with type hints and a Google-style docstring: transformers'
`get_json_schema` turns it into the JSON schema chat templates take as `tools=`. A config entry
names it by `_target_` and may fix some of its arguments (they are bound, and left out of what
the model is told). The model calls it by writing, in its turn,

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "37 + 48"}}
    </tool_call>

the format of Qwen2.5's template and of most ChatML ones (Hermes'); where a tokenizer's template
defines its own (`tokenizer.response_schema`), transformers' `parse_response` reads it. Each call
becomes a ToolResult: the tool's return value as text, or, for a call that cannot run (malformed
JSON, an unknown tool, arguments its signature does not take, a tool that raises or runs past
its time limit), an error the model reads in the tool's message and the run counts by kind.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hydra.utils import get_method
from omegaconf import OmegaConf

from grpo_cli.config import ConfigError, import_target
from grpo_cli.time_limit import TimeLimitExceeded, time_limit

TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)  # an unclosed tag runs to the end

# The kinds of bad call, as counted in rollout/tool_errors/<kind>.
MALFORMED = "malformed"  # not a JSON object with a "name" and an "arguments" object
UNKNOWN_TOOL = "unknown_tool"
BAD_ARGUMENTS = "bad_arguments"  # arguments the tool's signature does not take
RAISED = "raised"
TIMEOUT = "timeout"
ERROR_KINDS = (MALFORMED, UNKNOWN_TOOL, BAD_ARGUMENTS, RAISED, TIMEOUT)


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]  # the config entry's fixed arguments already bound
    schema: dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}


@dataclass(frozen=True)
class ToolCall:
    name: str | None  # None where the call was too malformed to name a tool
    arguments: dict[str, Any]
    error: str | None = None  # why it cannot run (MALFORMED); None for a well-formed call


@dataclass(frozen=True)
class ToolResult:
    call: ToolCall
    content: str  # what the model reads in the tool message
    error_kind: str | None  # one of ERROR_KINDS; None when the tool ran and returned


def build_tools(entries: Sequence[Any]) -> list[Tool]:
    """One Tool per rollout.tools entry ({_target_: module.function, name: optional, any fixed
    argument}). A ConfigError names the entry that cannot be imported or described."""
    tools: list[Tool] = []
    for index, entry in enumerate(entries):
        entry = OmegaConf.to_container(entry, resolve=True) if OmegaConf.is_config(entry) else dict(entry)
        where = f"rollout.tools[{index}]"
        target = entry.get("_target_")
        fn = import_target(target, where, get_method, "function")
        fixed = {key: value for key, value in entry.items() if key not in ("_target_", "name")}
        description = describe(fn, where, target, fixed)
        name = str(entry.get("name") or description["name"])
        if any(tool.name == name for tool in tools):
            raise ConfigError(f"{where}: a second tool named {name!r}; give one of them another `name`.")
        description["name"] = name
        tools.append(
            Tool(name, functools.partial(fn, **fixed) if fixed else fn, {"type": "function", "function": description})
        )
    return tools


def describe(fn: Callable[..., Any], where: str, target: str, fixed: dict[str, Any]) -> dict[str, Any]:
    """The function's JSON schema for the chat template, without the arguments `fixed` binds."""
    from transformers.utils import get_json_schema

    unknown = sorted(set(fixed) - set(inspect.signature(fn).parameters))
    if unknown:
        raise ConfigError(f"{where} ({target}) sets {unknown}, which the function does not take.")
    try:
        schema = get_json_schema(fn)
    except Exception as error:  # transformers' Type hint / Docstring parsing exceptions
        raise ConfigError(
            f"{where}._target_={target}: cannot describe it to the model ({error}). A tool needs a type "
            "hint on each argument and a Google-style docstring: a summary line, then `Args:` with a "
            "line `name: what it is` for each argument."
        ) from None
    function = schema.get("function", schema)  # transformers 5.2x wraps it as {"type": "function", "function": ...}
    parameters = function.setdefault("parameters", {"type": "object", "properties": {}})
    for key in fixed:
        parameters.get("properties", {}).pop(key, None)
    if "required" in parameters:
        parameters["required"] = [key for key in parameters["required"] if key not in fixed]
    return function


def parse_tool_calls(text: str, tokenizer: Any = None) -> list[ToolCall]:
    """The tool calls in one assistant turn's text, in order; [] when it calls none."""
    if tokenizer is not None and getattr(tokenizer, "response_schema", None):
        return _calls_by_template(text, tokenizer)
    return [_call_from_json(body.strip()) for body in TOOL_CALL.findall(text)]


def _calls_by_template(text: str, tokenizer: Any) -> list[ToolCall]:
    try:
        message = tokenizer.parse_response(text)
    except Exception as error:  # the model's text: anything may fail to parse
        return [ToolCall(None, {}, f"the tool call could not be read ({type(error).__name__}: {error})")]
    calls = []
    for entry in message.get("tool_calls") or []:
        function = entry.get("function", entry) if isinstance(entry, dict) else {}
        calls.append(_checked_call(function.get("name"), function.get("arguments", {})))
    return calls


def _call_from_json(body: str) -> ToolCall:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as error:
        return ToolCall(None, {}, f"the tool call is not valid JSON ({error.msg} at character {error.pos})")
    if not isinstance(data, dict):
        return ToolCall(None, {}, 'the tool call must be a JSON object {"name": ..., "arguments": {...}}')
    return _checked_call(data.get("name"), data.get("arguments", {}))


def _checked_call(name: Any, arguments: Any) -> ToolCall:
    if isinstance(arguments, str):  # some templates write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(name, str) or not name:
        return ToolCall(None, {}, 'the tool call has no "name" string')
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, f'the "arguments" of {name} must be a JSON object')
    return ToolCall(name, arguments)


def run_tool_call(call: ToolCall, tools: Sequence[Tool], timeout_s: float | None, max_chars: int) -> ToolResult:
    """Run one call, never raising: its result as text (at most `max_chars`), or the error the
    model reads. `timeout_s` cuts off a tool that hangs (time_limit: Python code anywhere, a sleep
    or a blocking read included; a C loop that never returns to Python is not stopped)."""
    if call.error is not None:
        return ToolResult(call, f"Error: {call.error}.", MALFORMED)
    by_name = {tool.name: tool for tool in tools}
    tool = by_name.get(call.name)
    if tool is None:
        known = ", ".join(sorted(by_name)) or "none"
        return ToolResult(call, f"Error: there is no tool named {call.name!r}; the tools are: {known}.", UNKNOWN_TOOL)
    try:
        inspect.signature(tool.fn).bind(**call.arguments)
    except TypeError as error:
        return ToolResult(call, f"Error: {call.name} cannot take these arguments ({error}).", BAD_ARGUMENTS)
    try:
        with time_limit(timeout_s):
            value = tool.fn(**call.arguments)
            content = as_text(value)
    except TimeLimitExceeded:
        return ToolResult(call, f"Error: {call.name} ran longer than {timeout_s:g} s and was stopped.", TIMEOUT)
    except (Exception, SystemExit) as error:  # a tool may fail in any way on the model's arguments
        return ToolResult(call, f"Error: {call.name} raised {type(error).__name__}: {error}", RAISED)
    if len(content) > max_chars:
        content = content[:max_chars] + f" ... [{len(content) - max_chars} more characters cut]"
    return ToolResult(call, content, None)


def as_text(value: Any) -> str:
    """What the model reads for a tool's return value: strings as they are, else JSON where it
    can be written, else str()."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)
