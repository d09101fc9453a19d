"""Rule rewards on the shape of a completion: its layout, its length, its repetitions.

All take the reward signature fn(prompts, completions, **columns) -> list[float] and never raise
on model output. A penalty is never positive and a bonus never negative, so they can be weighted
beside a correctness reward without changing its sign.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any, Optional


@functools.lru_cache(maxsize=32)
def _layout(pattern: Optional[str], tags: tuple[str, ...]) -> re.Pattern:
    if pattern is not None:
        return re.compile(pattern, re.DOTALL)
    blocks = r"\s*".join(rf"<{re.escape(tag)}>.*?</{re.escape(tag)}>" for tag in tags)
    return re.compile(rf"\s*{blocks}\s*", re.DOTALL)


def format_reward(
    prompts: list[str],
    completions: list[str],
    pattern: Optional[str] = None,
    tags: Sequence[str] = ("think", "answer"),
    bonus: float = 0.5,
    **_: Any,
) -> list[float]:
    """`bonus` when the whole completion has the layout, else 0.

    Default layout: `<think>...</think>` then `<answer>...</answer>`, whitespace around and
    between them allowed (`tags` lists other tags, in order). `pattern` replaces it with your
    own regex, which must match the whole completion (re.fullmatch, `.` matching newlines).
    Example: "<think>2+2</think> <answer>4</answer>" -> 0.5; "4" -> 0.0.
    """
    layout = _layout(pattern, tuple(tags))
    return [bonus if layout.fullmatch(text) else 0.0 for text in completions]


def length_penalty(
    prompts: list[str],
    completions: list[str],
    completion_length: Optional[list[int]] = None,
    target: int = 256,
    coef: float = 0.001,
    **_: Any,
) -> list[float]:
    """-coef * max(0, tokens - target): nothing up to `target` tokens, then a linear penalty.

    Tokens are the completion's own token count, which the trainer passes as
    `completion_length`; where it is not given (e.g. a call from your own code) whitespace-
    separated words are counted instead. Example, target 4, coef 0.1, 6 tokens: -0.2.
    """
    lengths = completion_length if completion_length is not None else [len(t.split()) for t in completions]
    return [-coef * max(0, int(length) - target) for length in lengths]


def repetition_penalty(
    prompts: list[str], completions: list[str], ngram: int = 3, coef: float = 1.0, **_: Any
) -> list[float]:
    """-coef * (fraction of the completion's word n-grams that repeat an earlier one).

    The usual cure for a policy that learns to loop ("output repeats"). Completions shorter
    than `ngram` words get 0. Example, ngram 2: "a b a b a b" has n-grams ab ba ab ba ab: 5,
    of which 2 distinct, so 3 repeats: -0.6.
    """
    scores = []
    for text in completions:
        words = text.split()
        grams = [tuple(words[i : i + ngram]) for i in range(len(words) - ngram + 1)]
        scores.append(-coef * (len(grams) - len(set(grams))) / len(grams) if grams else 0.0)
    return scores
