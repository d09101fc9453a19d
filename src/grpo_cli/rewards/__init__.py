"""Stage 3, reward scoring. A reward function is any callable

    fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]

where `columns` are the dataset's fields repeated per completion (`answer` is always there: the
column named by data.answer_field). `None` means "no opinion" for that completion. Functions
are named in config by `_target_` with a `weight` and their own keyword arguments; the built-in
ones below are importable as `grpo_cli.rewards.<name>`.
"""

from grpo_cli.rewards.code import code_execution
from grpo_cli.rewards.environment import environment_reward
from grpo_cli.rewards.format import format_reward, length_penalty, overlong_penalty, repetition_penalty
from grpo_cli.rewards.math import exact_match, math_accuracy
from grpo_cli.rewards.reward_model import reward_model

__all__ = [
    "code_execution",
    "environment_reward",
    "exact_match",
    "format_reward",
    "length_penalty",
    "math_accuracy",
    "overlong_penalty",
    "repetition_penalty",
    "reward_model",
]
