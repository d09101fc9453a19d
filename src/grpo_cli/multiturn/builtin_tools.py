"""Tools that come with grpo-cli, for rollout.tools: `_target_: grpo_cli.multiturn.builtin_tools.calculator`.

Each is an ordinary tool (multiturn/tools.py): type hints and a Google-style docstring, which is
what the model is told (so the docstrings speak to the model; notes for people are comments). They raise on bad input; the trainer turns that into an error message.
"""

from __future__ import annotations

import ast
import operator

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
MAX_EXPONENT = 100  # 10 ** 10 ** 10 would hold the process for ever (a C loop: no timeout stops it)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: The arithmetic to compute, with numbers, + - * / // % ** and parentheses, e.g. "37 + 48".
    """
    tree = ast.parse(expression.strip(), mode="eval")
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is over {MAX_EXPONENT}")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"{ast.unparse(node)!r} is not arithmetic (numbers, + - * / // % ** and parentheses)")


PYTHON_TIMEOUT_S = 5.0  # the sandbox's own limit: under rollout.tool_timeout_s, so the sandbox ends first


def python(code: str) -> str:
    """Run a Python program and return what it printed.

    Args:
        code: The program's source; print() what you want to read back.
    """
    from grpo_cli.rewards.sandbox import run_sandboxed  # the sandbox of the code rewards (docs/SANDBOX.md)

    result = run_sandboxed(code, timeout=PYTHON_TIMEOUT_S, memory_mb=512, max_output_bytes=8_000)
    if result.timed_out:
        return f"the program ran longer than {PYTHON_TIMEOUT_S:g} s and was stopped"
    output = result.stdout
    if result.exit_code:
        output += result.stderr[-2000:]
    return output
