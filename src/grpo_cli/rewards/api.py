"""Calling reward functions safely, and combining them into one reward per completion.

A function that raises, returns the wrong length, or returns NaN/inf is not allowed to stop the
run on its own: the scores it lost count as None ("no opinion"), the failure is recorded by
name in `Rewards.errors` (first reason) and `Rewards.error_counts`, and logged as
`reward/<name>/errors`. Only a function that fails on more than reward.max_error_fraction of a
call's completions stops the run, with a message naming it (a bug, not a bad completion).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Set
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from hydra.utils import get_method
from omegaconf import OmegaConf

from grpo_cli.config import ConfigError, import_target, normalizes_each
from grpo_cli.records import Rewards, Rollout
from grpo_cli.rewards.shaping import combine_rewards
from grpo_cli.time_limit import TimeLimitExceeded, time_limit

RESERVED_KEYS = ("_target_", "weight", "name")


@dataclass
class RewardFunction:
    name: str
    fn: Callable[..., Any]
    weight: float
    accepts_any_column: bool  # has **kwargs: gets every column
    column_names: tuple[str, ...]  # else: only the columns it names


def build_reward_functions(entries: Any, shared: dict[str, Any] | None = None) -> list[RewardFunction]:
    """One RewardFunction per config entry. `shared` holds group-level settings (reward.workers)
    given to each function whose signature names them, unless its entry sets them itself."""
    functions: list[RewardFunction] = []
    for index, entry in enumerate(entries):
        entry = OmegaConf.to_container(entry, resolve=True) if OmegaConf.is_config(entry) else dict(entry)
        target = entry["_target_"]
        fn = import_target(target, f"reward.functions[{index}]", get_method, "function")
        arguments = {key: value for key, value in entry.items() if key not in RESERVED_KEYS}
        name = base_name = str(entry.get("name") or target.rsplit(".", 1)[-1])
        explicit = {str(e.get("name")) for i, e in enumerate(entries) if i != index and e.get("name")}
        taken = {f.name for f in functions} | explicit
        suffix = 1
        while name in taken:  # two entries with one name would overwrite each other's metrics
            suffix += 1
            name = f"{base_name}_{suffix}"
        parameters = inspect.signature(fn).parameters.values()
        for key, value in (shared or {}).items():
            if key not in arguments and any(p.name == key for p in parameters):
                arguments[key] = value
        check = getattr(fn, "check_arguments", None)  # a function's own check of its settings
        problem = check(**arguments) if check is not None else None
        if problem:
            raise ConfigError(f"reward.functions[{index}] ({name}): {problem} Nothing was loaded.")
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


class RewardCall(NamedTuple):
    values: list[float | None]  # [N] one score per completion, None = no opinion or lost
    failures: int  # completions whose score was lost to an error
    error: str | None  # why the first failure happened; None when nothing failed


def call_reward(
    function: RewardFunction,
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list[Any]],
    timeout: float | None = None,
) -> RewardCall:
    """Call one reward function on a batch, never raising.

    - The batch call raises (SystemExit included: libraries call sys.exit): the function is
      called again on each completion alone, so one malformed completion costs only its own
      score; the ones that still raise are lost.
    - It runs past `timeout` seconds: the whole batch is lost, with no retry (a hang is a bug).
    - It returns no sequence (a dict would be scored by its keys, a set in no order), or a wrong
      number of values: the whole batch is lost (the values cannot be matched up).
    - A value that is not a finite number or None (NaN, inf, a string): that value is lost.
    Lost scores are None and counted in `failures`. The function gets its own copies of the lists,
    so one that edits them cannot change what the next function scores.
    """
    count = len(completions)
    passed = {
        key: list(values)
        for key, values in columns.items()
        if function.accepts_any_column or key in function.column_names
    }
    try:
        with time_limit(timeout):
            returned = function.fn(list(prompts), list(completions), **passed)
            if isinstance(returned, (Mapping, Set, str, bytes)) or not isinstance(returned, Iterable):
                return RewardCall(
                    [None] * count,
                    count,
                    f"returned a {type(returned).__name__}; a reward "
                    "function returns a list of one number (or None) per completion",
                )
            values = list(returned)  # within the limit: a generator runs here
    except TimeLimitExceeded:
        return RewardCall(
            [None] * count, count, f"ran longer than reward.timeout_s={timeout:g} s on {count} completions"
        )
    except (Exception, SystemExit) as error:  # a user's function may fail in any way; the run goes on
        if count == 1:
            return RewardCall([None], 1, f"raised {type(error).__name__}: {error}")
        return _call_one_by_one(function, prompts, completions, passed, timeout)
    if len(values) != count:
        return RewardCall([None] * count, count, f"returned {len(values)} values for {count} completions")
    scores: list[float | None] = []
    failures, why = 0, None
    for value in values:
        score = _as_score(value)
        if score is _INVALID:
            failures += 1
            why = why or f"returned {value!r}; each value must be a finite number or None"
            score = None
        scores.append(score)
    return RewardCall(scores, failures, why)


def _call_one_by_one(
    function: RewardFunction,
    prompts: list[str],
    completions: list[str],
    passed: dict[str, list[Any]],
    timeout: float | None,
) -> RewardCall:
    scores: list[float | None] = []
    failures, why = 0, None
    for index in range(len(completions)):
        single = {key: values[index : index + 1] for key, values in passed.items()}
        result = call_reward(function, prompts[index : index + 1], completions[index : index + 1], single, timeout)
        scores.append(result.values[0] if len(result.values) == 1 else None)
        failures += result.failures
        why = why or result.error
    return RewardCall(scores, failures, why)


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


class RewardError(ConfigError):
    """A reward function failed on too many completions of a step: a bug, not bad luck."""


class RewardScorer:
    """Scores completions with the configured functions (reward.functions) and combines them
    with reward.clip and reward.normalize_each (see combine_rewards).

    A function whose scores are lost (see call_reward) on more than `max_error_fraction` of the
    completions of one call stops the run with a RewardError naming it and its first error.
    """

    def __init__(
        self,
        entries: Any,
        clip: Any = None,
        normalize_each: bool = False,
        std_eps: float = 1e-4,
        max_error_fraction: float = 1.0,
        workers: int = 1,
        timeout: float | None = None,
        max_new_tokens: int | None = None,
    ):
        shared = {"workers": workers, "max_new_tokens": max_new_tokens}
        self.functions = build_reward_functions(entries, shared=shared)
        self.weights = {function.name: function.weight for function in self.functions}
        self.clip = (float(clip[0]), float(clip[1])) if clip is not None else None
        self.normalize_each = normalize_each
        self.std_eps = std_eps
        self.max_error_fraction = max_error_fraction
        self.timeout = timeout

    @classmethod
    def from_config(cls, reward: Any, std_eps: float, max_new_tokens: int | None = None) -> RewardScorer:
        """From the reward config group (functions, clip, normalize_each, max_error_fraction,
        workers, timeout_s), trainer.std_eps and sampler.max_new_tokens (given to the functions
        that name it, e.g. overlong_penalty)."""
        return cls(
            reward.functions,
            reward.clip,
            normalizes_each(reward),
            std_eps,
            reward.max_error_fraction,
            reward.workers,
            reward.timeout_s,
            max_new_tokens,
        )

    def for_eval(self, cfg: Any) -> RewardScorer:
        """The greedy eval's scorer: eval.functions with this scorer's clip, workers and timeout,
        or this scorer itself where eval.functions is unset."""
        functions = cfg.get("eval", {}).get("functions") if hasattr(cfg, "get") else None
        if not functions:
            return self
        reward = cfg.reward
        try:
            return RewardScorer(
                functions,
                reward.clip,
                False,
                self.std_eps,
                reward.max_error_fraction,
                reward.workers,
                reward.timeout_s,
                cfg.sampler.max_new_tokens,
            )
        except ConfigError as error:
            raise ConfigError(str(error).replace("reward.functions[", "eval.functions[")) from None

    @property
    def names(self) -> list[str]:
        return [function.name for function in self.functions]

    def score_texts(
        self, prompts: list[str], completions: list[str], columns: dict[str, list[Any]], shape: tuple[int, ...]
    ) -> Rewards:
        per_function, errors, error_counts = {}, {}, {}
        for function in self.functions:
            values, failures, error = call_reward(function, prompts, completions, columns, self.timeout)
            error_counts[function.name] = failures
            if error is not None:
                errors[function.name] = error
            if failures > self.max_error_fraction * len(completions):
                raise RewardError(
                    f"Reward function {function.name} failed on {failures} of {len(completions)} "
                    f"completions, more than reward.max_error_fraction={self.max_error_fraction}; "
                    f"the first failure: {error}. A reward function must return one finite number "
                    "(or None for no opinion) per completion and should not raise on malformed model "
                    "output. Fix it (or raise reward.max_error_fraction), then continue from the last "
                    "checkpoint with trainer.resume=true."
                )
            scores = torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32)
            per_function[function.name] = scores.view(shape)
        total = combine_rewards(per_function, self.weights, self.clip)  # None adds nothing
        return Rewards(total=total, per_function=per_function, errors=errors, error_counts=error_counts)

    def score(self, rollout: Rollout) -> Rewards:
        """Rewards of a rollout's B x G completions; with normalize_each also `shaped`, the sum
        of per-function group z-scores that the advantages are computed from.

        Functions also receive `completion_length` (tokens of each completion, EOS included)
        when they accept it.
        """
        shape = (rollout.num_prompts, rollout.group_size)
        columns = {**rollout.columns, "completion_length": rollout.trained_mask.sum(dim=1).tolist()}
        rewards = self.score_texts(rollout.prompts, rollout.completions, columns, shape)
        if self.normalize_each:
            rewards.shaped = combine_rewards(
                rewards.per_function, self.weights, self.clip, normalize_each=True, std_eps=self.std_eps
            )
        return rewards
