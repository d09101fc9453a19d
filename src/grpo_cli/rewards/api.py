"""Calling reward functions safely, and combining them into one reward per completion.

A function that raises, returns the wrong length, or returns NaN/inf is not allowed to stop the
run: that call's values count as None ("no opinion"), and the failure is recorded by name in
`Rewards.errors` and logged as `reward/<name>/errors`.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from hydra.utils import get_method
from omegaconf import OmegaConf

from grpo_cli.advantages import combine_rewards
from grpo_cli.config import ConfigError
from grpo_cli.records import Rewards, Rollout

RESERVED_KEYS = ("_target_", "weight", "name")


@dataclass
class RewardFunction:
    name: str
    fn: Callable[..., Any]
    weight: float
    accepts_any_column: bool  # has **kwargs: gets every column
    column_names: tuple[str, ...]  # else: only the columns it names


def build_reward_functions(entries: Any) -> list[RewardFunction]:
    functions: list[RewardFunction] = []
    for index, entry in enumerate(entries):
        entry = OmegaConf.to_container(entry, resolve=True) if OmegaConf.is_config(entry) else dict(entry)
        target = entry["_target_"]
        try:
            fn = get_method(target)
        except Exception as error:
            raise ConfigError(
                f"reward.functions[{index}]._target_={target}: cannot import it ({error}). Give a "
                "module.function path; a function in your own file needs its folder on PYTHONPATH."
            ) from None
        arguments = {key: value for key, value in entry.items() if key not in RESERVED_KEYS}
        name = base_name = str(entry.get("name") or target.rsplit(".", 1)[-1])
        explicit = {str(e.get("name")) for i, e in enumerate(entries) if i != index and e.get("name")}
        taken = {f.name for f in functions} | explicit
        suffix = 1
        while name in taken:  # two entries with one name would overwrite each other's metrics
            suffix += 1
            name = f"{base_name}_{suffix}"
        parameters = inspect.signature(fn).parameters.values()
        functions.append(
            RewardFunction(
                name=name,
                fn=functools.partial(fn, **arguments) if arguments else fn,
                weight=float(entry.get("weight", 1.0)),
                accepts_any_column=any(p.kind is p.VAR_KEYWORD for p in parameters),
                column_names=tuple(p.name for p in parameters),
            )
        )
    return functions


def call_reward(function: RewardFunction, prompts: list[str], completions: list[str],
                columns: dict[str, list[Any]]) -> tuple[list[float | None], str | None]:
    """(values, None) on success; ([None] * N, why) when the call failed in any way."""
    count = len(completions)
    passed = {
        key: values
        for key, values in columns.items()
        if function.accepts_any_column or key in function.column_names
    }
    try:
        values = list(function.fn(prompts, completions, **passed))
    except Exception as error:  # a user's function may fail in any way; the run goes on
        return [None] * count, f"raised {type(error).__name__}: {error}"
    if len(values) != count:
        return [None] * count, f"returned {len(values)} values for {count} completions"
    scores: list[float | None] = []
    for value in values:
        score = _as_score(value)
        if score is _INVALID:
            return [None] * count, f"returned {value!r}; each value must be a finite number or None"
        scores.append(score)
    return scores, None


_INVALID = object()


def _as_score(value: Any) -> Any:
    """None, or a finite float from any real number (Python, numpy or a 0-d tensor); else _INVALID."""
    if value is None:
        return None
    if isinstance(value, (bool, str, bytes)):
        return _INVALID
    try:
        score = float(value)
    except (TypeError, ValueError, RuntimeError):
        return _INVALID
    return score if math.isfinite(score) else _INVALID


class RewardScorer:
    """Scores completions with the configured functions (reward.functions) and combines them
    with reward.clip and reward.normalize_each (see combine_rewards)."""

    def __init__(self, entries: Any, clip: Any = None, normalize_each: bool = False, std_eps: float = 1e-4):
        self.functions = build_reward_functions(entries)
        self.weights = {function.name: function.weight for function in self.functions}
        self.clip = (float(clip[0]), float(clip[1])) if clip is not None else None
        self.normalize_each = normalize_each
        self.std_eps = std_eps

    @property
    def names(self) -> list[str]:
        return [function.name for function in self.functions]

    def score_texts(self, prompts: list[str], completions: list[str],
                    columns: dict[str, list[Any]], shape: tuple[int, ...]) -> Rewards:
        per_function, errors = {}, {}
        for function in self.functions:
            values, error = call_reward(function, prompts, completions, columns)
            if error is not None:
                errors[function.name] = error
            scores = torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32)
            per_function[function.name] = scores.view(shape)
        total = combine_rewards(per_function, self.weights, self.clip)  # None adds nothing
        return Rewards(total=total, per_function=per_function, errors=errors)

    def score(self, rollout: Rollout) -> Rewards:
        """Rewards of a rollout's B x G completions; with normalize_each also `shaped`, the sum
        of per-function group z-scores that the advantages are computed from."""
        shape = (rollout.num_prompts, rollout.group_size)
        rewards = self.score_texts(rollout.prompts, rollout.completions, rollout.columns, shape)
        if self.normalize_each:
            rewards.shaped = combine_rewards(rewards.per_function, self.weights, self.clip,
                                             normalize_each=True, std_eps=self.std_eps)
        return rewards
