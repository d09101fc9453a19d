"""Built-in synthetic tasks: prompts with known answers, generated in memory, nothing to download.

`synthetic:addition` is the embedded default: single-digit addition, `Question: what is 3 + 4?
Answer:` with the answer ` 7`. It is small enough that a 0.6M-parameter model learns it on two CPU
cores in minutes, and hard enough that a short supervised warm start leaves most answers wrong,
so GRPO has something real to learn (a denser per-digit reward, or two-digit numbers, gave the
policy shortcuts or no signal in the measurements recorded in the foundation issue).
"""

from __future__ import annotations

import random
from typing import Callable

Row = dict[str, str]


def addition_prompt(a: int, b: int) -> str:
    return f"Question: what is {a} + {b}? Answer:"


def addition_rows() -> list[Row]:
    """All 100 single-digit problems, in a fixed order."""
    return [
        {"prompt": addition_prompt(a, b), "answer": str(a + b)} for a in range(10) for b in range(10)
    ]


def addition_eval_rows(size: int, seed: int) -> list[Row]:
    """`size` questions drawn uniformly (with repetition: there are only 100) with their own RNG."""
    rows = addition_rows()
    rng = random.Random(f"addition-eval-{seed}")
    return [rng.choice(rows) for _ in range(size)]


SyntheticTask = tuple[Callable[[], list[Row]], Callable[[int, int], list[Row]]]

SYNTHETIC_TASKS: dict[str, SyntheticTask] = {
    "addition": (addition_rows, addition_eval_rows),
}
SYNTHETIC_PREFIX = "synthetic:"


def synthetic_task_name(path: str) -> str | None:
    """`synthetic:addition` -> `addition`; None for anything that is not a synthetic task name."""
    if path.startswith(SYNTHETIC_PREFIX):
        return path[len(SYNTHETIC_PREFIX):]
    return None
