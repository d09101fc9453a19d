"""The warning detector on crafted metric sequences: each known failure pattern fires, and noise
around a flat line does not."""

from __future__ import annotations

import random

import pytest

from grpo_cli.safety.health import correlation_with_step, health_warnings

HEALTHY = {"advantage/zero_std_fraction": 0.25, "completion/truncated_fraction": 0.05}


def rows(count: int, **series) -> list[dict]:
    """`count` training rows; each keyword is a metric's values (a list) or a constant."""
    made = []
    for index in range(count):
        row = {"step": index + 1, "reward/mean": 0.5, "kl": 0.01, **HEALTHY}
        for key, values in series.items():
            row[key.replace("__", "/")] = values[index] if isinstance(values, list) else values
        made.append(row)
    return made


def kinds(history: list[dict]) -> list[str]:
    return [kind for kind, _ in health_warnings(history)]


def test_correlation_with_step_by_hand():
    assert correlation_with_step([1, 2, 3]) == pytest.approx(1.0)
    # [3, 1, 2]: index mean 1, value mean 2; cov = (-1)(1) + 0 + (1)(0) = -1; spreads sqrt2, sqrt2
    assert correlation_with_step([3, 1, 2]) == pytest.approx(-0.5)
    assert correlation_with_step([2, 2, 2]) == 0.0
    assert correlation_with_step([5.0]) == 0.0


def test_a_healthy_run_has_no_warning():
    noise = random.Random(0)
    history = rows(
        40,
        reward__mean=[0.5 + noise.uniform(-0.1, 0.1) for _ in range(40)],
        kl=[0.02 + noise.uniform(-0.01, 0.01) for _ in range(40)],
    )
    assert kinds(history) == []


def test_all_groups_zero_std_for_ten_steps():
    nine = rows(12, advantage__zero_std_fraction=[0.5, 0.5, 0.5] + [1.0] * 9)
    assert kinds(nine) == []  # nine steps in a row: not yet
    ten = rows(12, advantage__zero_std_fraction=[0.5, 0.5] + [1.0] * 10)
    assert kinds(ten) == ["zero_std"]
    assert "prompts too easy" in health_warnings(ten)[0][1] and "temperature too low" in health_warnings(ten)[0][1]


def test_truncated_fraction_above_half():
    assert (
        kinds(rows(3, completion__truncated_fraction=[0.9, 0.9, 0.5])) == []
    )  # the last step counts; 50% is not above
    warnings = health_warnings(rows(3, completion__truncated_fraction=[0.0, 0.0, 0.75]))
    assert warnings == [
        (
            "truncated",
            "75% of completions hit max_new_tokens without ending: max_new_tokens too small, or the replies ramble",
        )
    ]


def test_kl_rising_for_twenty_steps():
    noise = random.Random(1)
    rising = [0.01 * (1 + 0.2 * i) + noise.uniform(-0.003, 0.003) for i in range(20)]
    assert kinds(rows(20, kl=rising)) == ["kl_rising"]
    assert kinds(rows(19, kl=rising[:19])) == []  # fewer than 20 steps: no verdict yet
    spike = [0.01] * 19 + [0.5]  # one spike at the end is not a rise (r = 0.38)
    assert kinds(rows(20, kl=spike)) == []


def test_reward_falling_while_kl_rises():
    kl = [0.01 + 0.002 * i for i in range(20)]
    falling = [0.8 - 0.02 * i for i in range(20)]
    assert kinds(rows(20, kl=kl, reward__mean=falling)) == ["kl_rising", "diverging"]
    rising_reward = [0.2 + 0.02 * i for i in range(20)]  # KL rising while reward rises: only the KL warning
    assert kinds(rows(20, kl=kl, reward__mean=rising_reward)) == ["kl_rising"]


def test_eval_only_rows_and_missing_values_are_ignored():
    history = [{"step": 0, "eval/accuracy": 0.3}] + rows(10, advantage__zero_std_fraction=1.0)
    assert kinds(history) == ["zero_std"]
    history[-1]["completion/truncated_fraction"] = None
    assert "truncated" not in kinds(history)


def test_the_newest_rows_decide_so_the_logger_passes_only_those():
    from grpo_cli.safety.health import HISTORY_NEEDED

    history = rows(100, kl=[0.01 * (1 + 0.2 * i) for i in range(100)])
    assert health_warnings(history[-HISTORY_NEEDED:]) == health_warnings(history)
