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


def overlong_penalty(
    prompts: list[str],
    completions: list[str],
    completion_length: Optional[list[int]] = None,
    max_new_tokens: Optional[int] = None,
    buffer: Optional[int] = None,
    coef: float = 1.0,
    **_: Any,
) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): with L = max_new_tokens and
    C = buffer, a completion of n tokens gets 0 while n <= L - C, then coef * (L - C - n) / C,
    falling linearly to -coef at n = L (a truncated completion), and -coef beyond.

    The trainer passes `completion_length` (tokens, EOS included) and `max_new_tokens`
    (sampler.max_new_tokens); `buffer` defaults to a fifth of it (DAPO: 4096 of 20480).
    TRL's get_soft_overlong_punishment(max_completion_len=L, soft_punish_cache=C) is the same
    function. Example, L = 100, C = 20: 80 tokens -> 0, 90 -> -0.5, 100 -> -1.
    """
    limit = int(max_new_tokens) if max_new_tokens is not None else None
    problem = check_overlong_arguments(limit, buffer)
    if problem:
        raise ValueError(problem)
    cache = int(buffer) if buffer is not None else max(1, limit // 5)
    lengths = completion_length if completion_length is not None else [len(t.split()) for t in completions]
    return [coef * max(-1.0, min(0.0, (limit - cache - int(n)) / cache)) for n in lengths]


def check_overlong_arguments(
    max_new_tokens: Optional[int] = None, buffer: Optional[int] = None, **_: Any
) -> str | None:
    """What is wrong with overlong_penalty's arguments, or None (the trainer checks before loading)."""
    if max_new_tokens is None:
        return "overlong_penalty needs max_new_tokens (the trainer passes sampler.max_new_tokens)."
    if buffer is not None and not 1 <= int(buffer) <= int(max_new_tokens):
        return (
            f"overlong_penalty's buffer={buffer} must be between 1 and max_new_tokens={max_new_tokens}: "
            "the last `buffer` tokens before the limit are where the penalty grows (DAPO: a fifth)."
        )
    return None


overlong_penalty.check_arguments = check_overlong_arguments  # build_reward_functions calls it
