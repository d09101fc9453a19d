"""The reward of a rollout environment (rollout.environment), as a reward function."""

from __future__ import annotations

from typing import Any, Optional


def environment_reward(
    prompts: list[str], completions: list[str], environment_reward: Optional[list[Any]] = None, **_: Any
) -> list[Optional[float]]:
    """The environment's reward of each conversation (its last step that gave one); None where it
    gave none, or where the run has no environment (the column is then absent)."""
    if environment_reward is None:
        return [None] * len(completions)
    return [None if value is None else float(value) for value in environment_reward]
