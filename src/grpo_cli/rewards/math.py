"""Answer-checking rewards: exact match and math accuracy. They never raise on model output."""

from __future__ import annotations

import math
import re
from typing import Any, Optional

from math_verify import parse, verify

NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
ANSWER_PHRASES = re.compile(r"(?:the (?:final )?answer is|answer\s*:)\s*(.+)", re.IGNORECASE)


def _normalize(text: str) -> str:
    return " ".join(str(text).strip().rstrip(".").split()).lower()


def exact_match(prompts: list[str], completions: list[str], answer: list[Any], **_: Any) -> list[float]:
    """1.0 when the completion, stripped of surrounding space, case and a final period, equals
    the answer; else 0.0. Meant for short answers (`synthetic:addition`: " 7" vs "7")."""
    return [float(_normalize(c) == _normalize(a)) for c, a in zip(completions, answer)]


def reference_value(answer: Any) -> str:
    """A bare gold value from a bare value or a whole GSM8K solution ("... #### 72" -> "72")."""
    text = str(answer)
    return text.rsplit("####", 1)[1].strip() if "####" in text else text.strip()


def _last_boxed(text: str) -> Optional[str]:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[begin:index]
    return None


def extract_final_answer(completion: str) -> Optional[str]:
    """The completion's final answer: `#### x`, `\\boxed{x}`, `The answer is x`, `Answer: x`,
    else its last number. None when there is nothing that looks like an answer."""
    if "####" in completion:
        tail = completion.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0] if tail else None
    boxed = _last_boxed(completion)
    if boxed is not None:
        return boxed
    phrases = ANSWER_PHRASES.findall(completion)
    if phrases:
        return phrases[-1].strip().splitlines()[0]
    numbers = NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def _as_number(text: str) -> Optional[float]:
    """Plain numbers fast, without sympy: "$1,234." -> 1234.0, "3/4" -> 0.75; None otherwise."""
    match = NUMBER.search(text)
    if match is None:
        return None
    # Only treat the text as a number when little else is there (units and punctuation aside).
    rest = (text[: match.start()] + text[match.end() :]).strip(" .$")
    if rest and not re.fullmatch(r"[A-Za-z%]+", rest):
        return None
    value = match.group().replace("$", "").replace(",", "")
    try:
        if "/" in value:
            numerator, denominator = value.split("/")
            return float(numerator) / float(denominator)
        return float(value)
    except (ValueError, ZeroDivisionError):
        return None


def is_equivalent(predicted: str, gold: str) -> bool:
    left, right = _as_number(predicted), _as_number(gold)
    if left is not None and right is not None:
        # Tight: a relative 1e-6 would call 1,450,001 equal to 1,450,000.
        return math.isclose(left, right, rel_tol=1e-9, abs_tol=1e-9)
    try:
        return bool(verify(parse(_latex(gold)), parse(_latex(predicted))))
    except Exception:  # math-verify on arbitrary model text: any failure means "not equal"
        return False


def _latex(text: str) -> str:
    return text if "$" in text else f"${text}$"


def math_accuracy(
    prompts: list[str], completions: list[str], answer: list[Any], layout: Optional[str] = None, **_: Any
) -> list[float]:
    """1.0 when the completion's final answer equals the reference answer, else 0.0.

    Numbers are compared as numbers (thousands separators, `$`, units and a trailing period
    ignored); anything else (fractions, LaTeX) through math-verify's equivalence check. With
    `layout` (a regex), a completion that does not match it as a whole scores 0.0 whatever its
    answer: e.g. `\\s*(\\d+ [-+*] \\d+ = )?\\d+\\.?\\s*` takes "7 * 8 = 56" and "56", not "56. Next...".
    """
    shape = re.compile(layout, re.DOTALL) if layout is not None else None
    scores = []
    for completion, gold in zip(completions, answer):
        if shape is not None and not shape.fullmatch(completion):
            scores.append(0.0)
            continue
        predicted = extract_final_answer(completion)
        scores.append(float(predicted is not None and is_equivalent(predicted, reference_value(gold))))
    return scores
