"""Environments for multi-turn rollouts (rollout.environment): stateful tasks the policy acts in,
a turn at a time, such as a game or a multi-step puzzle.

An environment is a class, named by `_target_` (any other key of the config entry is passed to
its constructor); the rollout makes one instance per conversation, so an instance may keep the
episode's state in its attributes:

    class NumberGuessing:
        def reset(self, row: dict) -> list[dict]:  # the dataset row -> the opening messages
            ...
        def step(self, messages: list[dict]) -> tuple[list[dict], float | None, bool]:
            ...  # the conversation so far, the policy's last turn at the end ->
                 # (messages to append, the episode's reward or None, whether it is over)

The reward of the last step that gave one reaches the reward stage as the column
`environment_reward` (grpo_cli.rewards.environment_reward scores it), beside the reward
functions. A step that raises on the policy's text ends the episode without a reward and is
counted (rollout/tool_errors/environment); a step that returns something other than
the triple above is a bug in the environment, and its error names the class.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from hydra.utils import get_class
from omegaconf import OmegaConf

from grpo_cli.config import ConfigError, import_target

WHERE = "rollout.environment"


class Environment(Protocol):
    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]: ...

    def step(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], float | None, bool]: ...


@dataclass(frozen=True)
class EnvironmentStep:
    messages: list[dict[str, Any]]  # to append to the conversation (a user or tool turn, usually one)
    reward: float | None  # the episode's reward, where this step gives one
    done: bool
    error: str | None = None  # the exception the step raised on the policy's text; done, no reward


def environment_factory(entry: Any) -> Callable[[], Environment]:
    """A maker of fresh environments from the rollout.environment entry ({_target_: module.Class,
    constructor arguments...}). A ConfigError names what cannot be imported or built."""
    entry = OmegaConf.to_container(entry, resolve=True) if OmegaConf.is_config(entry) else dict(entry)
    target = entry.pop("_target_", None)
    cls = import_target(target, WHERE, get_class, "class")
    missing = [name for name in ("reset", "step") if not callable(getattr(cls, name, None))]
    if missing:
        raise ConfigError(f"{WHERE}._target_={target} has no {' or '.join(missing)} method: see docs/MULTITURN.md.")
    try:
        cls(**entry)  # a wrong constructor argument fails here, at start-up, not in the first rollout
    except Exception as error:
        raise ConfigError(f"{WHERE}: {target}(**{entry}) failed: {type(error).__name__}: {error}") from None
    return lambda: cls(**entry)


def reset_messages(environment: Environment, row: dict[str, Any]) -> list[dict[str, Any]]:
    """The episode's opening messages, checked: reset works on the dataset's row, not on the
    policy's text, so a failure is the environment's or the data's and stops the run."""
    name = type(environment).__name__
    try:
        messages = environment.reset(row)
    except Exception as error:
        raise ConfigError(
            f"{WHERE}: {name}.reset failed on the dataset row {sorted(row)} with {type(error).__name__}: "
            f"{error}. Check the data's columns against what the environment reads."
        ) from None
    return checked_messages(messages, f"{name}.reset")


def environment_step(environment: Environment, messages: list[dict[str, Any]]) -> EnvironmentStep:
    """One step on the policy's last turn, never raising on what the policy wrote."""
    name = type(environment).__name__
    try:
        result = environment.step(messages)
    except Exception as error:  # the policy's text may break an environment in any way
        return EnvironmentStep([], None, True, f"{type(error).__name__}: {error}")
    if not (isinstance(result, tuple) and len(result) == 3):
        raise ConfigError(
            f"{WHERE}: {name}.step returned {type(result).__name__}; it must return a tuple "
            "(messages to append, reward or None, done)."
        )
    new_messages, reward, done = result
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            raise ConfigError(f"{WHERE}: {name}.step returned the reward {reward!r}; give a finite number or None.")
        reward = float(reward)
    return EnvironmentStep(checked_messages(new_messages, f"{name}.step"), reward, bool(done))


def checked_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not all(
        isinstance(message, dict) and isinstance(message.get("role"), str) and "content" in message
        for message in messages
    ):
        raise ConfigError(
            f"{WHERE}: {where} returned {messages!r:.200}; give a list of messages, each a dict with a "
            '"role" and a "content", e.g. [{"role": "user", "content": "Higher."}].'
        )
    return messages


class NumberGuessing:
    """An example environment: the policy guesses a whole number from 1 to `high`, told "higher"
    or "lower" after each guess. Reward 1 for finding it, 0 when the guesses run out or a turn
    holds no number. The secret is the dataset row's `answer` column."""

    def __init__(self, high: int = 100, max_guesses: int = 7):
        if high < 1 or max_guesses < 1:
            raise ValueError(f"high ({high}) and max_guesses ({max_guesses}) must be at least 1")
        self.high, self.max_guesses = high, max_guesses
        self.secret, self.guesses = 0, 0

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        self.secret, self.guesses = int(row["answer"]), 0
        question = (
            f"I am thinking of a whole number from 1 to {self.high}. Guess it: answer with one number. "
            f"You have {self.max_guesses} guesses; after each I say higher or lower."
        )
        return [{"role": "user", "content": question}]

    def step(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], float | None, bool]:
        self.guesses += 1
        numbers = re.findall(r"-?\d+", str(messages[-1].get("content", "")))
        if not numbers:
            return [{"role": "user", "content": "That holds no number."}], 0.0, True
        guess = int(numbers[-1])
        if guess == self.secret:
            return [{"role": "user", "content": "Correct."}], 1.0, True
        if self.guesses >= self.max_guesses:
            return [{"role": "user", "content": f"No guesses left; it was {self.secret}."}], 0.0, True
        hint = "Higher." if guess < self.secret else "Lower."
        return [{"role": "user", "content": hint}], None, False
