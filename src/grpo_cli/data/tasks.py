"""Built-in synthetic tasks: prompts with known answers, generated in memory, nothing to download.

`synthetic:addition` is the embedded default: single-digit addition, `Question: what is 3 + 4?
Answer:` with the answer ` 7`. It is small enough that a 0.6M-parameter model learns it on two CPU
cores in minutes, and hard enough that a short supervised warm start leaves most answers wrong,
so GRPO has something real to learn (a denser per-digit reward, or two-digit numbers, gave the
policy shortcuts or no signal in the measurements recorded in the foundation issue).

`synthetic:plus-minus-one` and the other arithmetic tasks (ARITHMETIC_TASKS) are for real chat
models: `What is 500 - 1?` with the answer `499`, asked through the chat template. Each has a
fixed held-out share that is never trained on; the eval reads it.
"""

from __future__ import annotations

import functools
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass

TaskRow = dict[str, str]


def addition_prompt(a: int, b: int) -> str:
    return f"Question: what is {a} + {b}? Answer:"


def addition_rows() -> list[TaskRow]:
    """All 100 single-digit problems, in a fixed order."""
    return [{"prompt": addition_prompt(a, b), "answer": str(a + b)} for a in range(10) for b in range(10)]


def addition_eval_rows(size: int, seed: int) -> list[TaskRow]:
    """`size` questions drawn uniformly (with repetition: there are only 100) with their own RNG."""
    rows = addition_rows()
    rng = random.Random(f"addition-eval-{seed}")
    return [rng.choice(rows) for _ in range(size)]


@dataclass(frozen=True)
class ArithmeticTask:
    """`What is a <op> b?` for every operator in `operators`, every a in `first` and b in
    `second` (ranges, both ends included; for "-" only a >= b: no negative answers)."""

    operators: str
    first: tuple[int, int]
    second: tuple[int, int]


ARITHMETIC_TASKS: dict[str, ArithmeticTask] = {
    # conf=smollm2_arithmetic's task: 1,996 problems, N + 1 and N - 1 for N in 2..999. The others
    # are what scripts/probe_arithmetic.py measured before choosing it (README, the real-model
    # preset): once it has learned the layout, SmolLM2-135M is right on 0.13-0.65 of them (0.86
    # on add-one-digit, which has only 81 problems), and GRPO does not lift that in minutes.
    "plus-minus-one": ArithmeticTask("+-", (2, 999), (1, 1)),
    "small-mixed": ArithmeticTask("+-*", (2, 15), (2, 15)),
    "add-one-digit": ArithmeticTask("+", (1, 9), (1, 9)),
    "times-tables": ArithmeticTask("*", (2, 12), (2, 12)),
    "add-two-digit": ArithmeticTask("+", (10, 99), (10, 99)),
    "add-sub-two-by-one-digit": ArithmeticTask("+-", (10, 99), (1, 9)),
    "plus-times-ten": ArithmeticTask("+*", (2, 999), (10, 10)),
}
ARITHMETIC_EVAL_SHARE = 0.45  # of a task's problems, held out of training for the eval
OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def arithmetic_rows(task: str, split: str) -> list[TaskRow]:
    """Every problem of `task` in `split` ("train" or "eval"): a fixed shuffle of all problems,
    whose first ARITHMETIC_EVAL_SHARE is held out for the eval and never trained on."""
    spec = ARITHMETIC_TASKS[task]
    firsts, seconds = range(spec.first[0], spec.first[1] + 1), range(spec.second[0], spec.second[1] + 1)
    problems = [(a, op, b) for op in spec.operators for a in firsts for b in seconds if op != "-" or a >= b]
    random.Random(f"arithmetic-{task}").shuffle(problems)
    held_out = round(len(problems) * ARITHMETIC_EVAL_SHARE)
    chosen = problems[:held_out] if split == "eval" else problems[held_out:]
    return [{"prompt": f"What is {a} {op} {b}?", "answer": str(OPERATIONS[op](a, b))} for a, op, b in chosen]


SyntheticTask = tuple[Callable[[], list[TaskRow]], Callable[[int, int], list[TaskRow]]]

SYNTHETIC_TASKS: dict[str, SyntheticTask] = {
    "addition": (addition_rows, addition_eval_rows),
}
for _name in ARITHMETIC_TASKS:  # the held-out share is the eval, whatever the seed; `size` caps it
    SYNTHETIC_TASKS[_name] = (
        functools.partial(arithmetic_rows, _name, "train"),
        lambda size, seed, _name=_name: arithmetic_rows(_name, "eval")[:size],
    )
SYNTHETIC_PREFIX = "synthetic:"


def synthetic_task_name(path: str) -> str | None:
    """`synthetic:addition` -> `addition`; None for anything that is not a synthetic task name."""
    if path.startswith(SYNTHETIC_PREFIX):
        return path[len(SYNTHETIC_PREFIX) :]
    return None
