"""Code-execution reward: run the model's Python against the dataset's tests, in the sandbox.

Each test runs in two sandboxed processes joined by pipes (`grpo_cli.rewards.remote_call`): the
model's code in one, the tests in the other, which calls the model's functions across and alone
gives the verdict. So the model's code never sees the tests' source, their frames or their
builtins, and what it returns reaches the tests as plain values only (docs/SANDBOX.md, "Two
processes"). A thread pool of `workers` threads only starts and waits on the processes, so the
isolation never depends on the threads.
"""

from __future__ import annotations

import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from grpo_cli.rewards.sandbox import run_connected

# The wire's source, copied into both programs: the sandboxed interpreter cannot import grpo_cli.
REMOTE_CALL_SOURCE = Path(__file__).with_name("remote_call.py").read_text()

# An opening fence with its language tag, the body, and the closing fence or the end of the
# text (a completion cut off by the token limit leaves its last block open).
FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
PYTHON_TAGS = {"python", "py", "python3", ""}


def extract_code(completion: str) -> str:
    """The last ```python, ```py or bare ``` block of the completion; the whole text when none.

    >>> extract_code("first\\n```python\\nx = 1\\n```\\nthen\\n```py\\nx = 2\\n```")
    'x = 2\\n'
    """
    blocks = [body for tag, body in FENCE.findall(str(completion)) if tag.lower() in PYTHON_TAGS]
    return blocks[-1] if blocks else str(completion)


def _test_snippets(entry: Any) -> list[str] | None:
    """The snippets to run, one sandbox run each; None when there is nothing to test."""
    if entry is None:
        return None
    if isinstance(entry, str):
        return [entry] if entry.strip() else None
    try:
        snippets = [str(snippet) for snippet in entry]
    except TypeError:
        return [str(entry)]
    return snippets or None


def _passes(code: str, snippet: str, timeout: float, memory_mb: int) -> bool | None:
    """True when the tests ran to their end and exited 0; False when not; None on timeout.

    The tests' program prints a random marker after the snippet: a run passes only when its own
    stdout ends with it, so a snippet that exits early does not pass. The marker lives in the
    tests' process only, which the model's code cannot read, signal or write to."""
    marker = f"__grpo_tests_done_{secrets.token_hex(8)}__"
    solution = f"{REMOTE_CALL_SOURCE}\n\nserve_solution({code!r}, *map(int, sys.argv[1:3]))\n"
    tests = f"{REMOTE_CALL_SOURCE}\n\nrun_tests({snippet!r}, *map(int, sys.argv[1:3]), marker={marker!r})\n"
    solution_run, result = run_connected(solution, tests, timeout=timeout, memory_mb=memory_mb)
    if result.timed_out or solution_run.timed_out:  # its CPU-time limit can end the model's code
        return None  # while the tests wait on it: that is a timeout too, not a failed test
    return result.exit_code == 0 and result.stdout_tail.endswith(f"{marker}\n")


def code_execution(
    prompts: list[str],
    completions: list[str],
    tests: list[Any],
    timeout: float = 5.0,
    timeout_penalty: float = -0.1,
    memory_mb: int = 512,
    workers: int = 4,
    **_: Any,
) -> list[float | None]:
    """Run each completion's code against its `tests` entry in the sandbox.

    The code is `extract_code(completion)`. A `tests` entry is
    - a string: one run of the tests against the code; 1.0 when it passes, else 0.0, and
      `timeout_penalty` when it timed out;
    - a list of strings: each snippet runs against the code in a run of its own; the reward is the
      fraction that passed (a timed-out run counts as failed), except when every run timed out:
      then `timeout_penalty`. E.g. 2 passed, 1 timed out of 3 -> 0.6667; 3 timed out -> -0.1;
    - None, "" or []: None ("no opinion").
    A run passes when the tests' process exits 0 after running the whole snippet: a test snippet
    must not call sys.exit itself. The snippet sees each public name the code defined (a
    builtin's name excepted): plain values as themselves, functions, classes and objects as
    handles that call across (docs/SANDBOX.md). Runs for all completions go in parallel on
    `workers` threads.
    """
    del prompts  # the tests say everything the reward needs
    snippets = [_test_snippets(entry) for entry in tests]
    jobs = [
        (index, extract_code(completions[index]), snippet)
        for index, entry in enumerate(snippets)
        for snippet in entry or []
    ]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        outcomes = list(pool.map(lambda job: _passes(job[1], job[2], timeout, memory_mb), jobs))
    by_completion: dict[int, list[bool | None]] = {}
    for (index, _code, _snippet), outcome in zip(jobs, outcomes):
        by_completion.setdefault(index, []).append(outcome)
    rewards: list[float | None] = []
    for index in range(len(completions)):
        results = by_completion.get(index)
        if not results:
            rewards.append(None)
        elif all(outcome is None for outcome in results):
            rewards.append(float(timeout_penalty))
        else:
            rewards.append(sum(outcome is True for outcome in results) / len(results))
    return rewards
