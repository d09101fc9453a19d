"""Known failure patterns of a GRPO run, recognised from the metric history as it is written.

`health_warnings(history)` looks at the rows of metrics.jsonl so far and returns a
(kind, message) pair for each pattern that is present now. The patterns are the ones practitioners look for in the curves:

- every group had equal rewards for `ZERO_STD_STEPS` steps: no advantage, no gradient. The
  prompts are too easy (or too hard) for the model, or the temperature is too low to vary;
- more than half the completions hit max_new_tokens without ending: the answers are cut off, so
  rewards score fragments;
- the KL to the reference has been rising for `TREND_STEPS` steps: the policy is drifting away
  (beta too small, or the learning rate too high);
- the reward has been falling while the KL rises over the same steps: the drift is not paying,
  the classic start of a collapse (or of reward hacking that the reward does not see).

"Rising" and "falling" are the correlation of the values with the step index over the window
(Pearson's r): it does not depend on the metric's scale, and noise around a flat line keeps r
near 0, so a single spike does not fire it.
"""

from __future__ import annotations

import math
from typing import Any

ZERO_STD_STEPS = 10
TRUNCATED_LIMIT = 0.5
TREND_STEPS = 20
KL_RISING_R = 0.8  # r of KL with the step index over TREND_STEPS steps
DIVERGING_R = 0.6  # both |r| for "reward falls while KL rises" (two signals together: less strict)
HISTORY_NEEDED = max(ZERO_STD_STEPS, TREND_STEPS) + 1  # the newest rows any pattern reads (+ row 0)

ZERO_STD = "all groups had equal rewards for {steps} steps: no learning signal (prompts too easy or too hard, or temperature too low)"
TRUNCATED = (
    "{fraction:.0%} of completions hit max_new_tokens without ending: max_new_tokens too small, or the replies ramble"
)
KL_RISING = (
    "KL has been rising for {steps} steps ({start:.3g} -> {end:.3g}): beta too small or the learning rate too high"
)
DIVERGING = "reward falling while KL rises over the last {steps} steps: the policy drifts without gain (raise beta, lower the lr)"


def health_warnings(history: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(kind, message) for each failure pattern present in `history` (metrics.jsonl rows, oldest
    first) now. The kinds are "zero_std", "truncated", "kl_rising" and "diverging"."""
    rows = [row for row in history if row.get("step", 0) > 0 and "reward/mean" in row]  # training steps
    warnings = []
    zero_std = _last(rows, "advantage/zero_std_fraction", ZERO_STD_STEPS)
    if len(zero_std) == ZERO_STD_STEPS and min(zero_std) >= 1.0:
        warnings.append(("zero_std", ZERO_STD.format(steps=ZERO_STD_STEPS)))
    truncated = _last(rows, "completion/truncated_fraction", 1)
    if truncated and truncated[0] > TRUNCATED_LIMIT:
        warnings.append(("truncated", TRUNCATED.format(fraction=truncated[0])))
    kl = _last(rows, "kl", TREND_STEPS)
    reward = _last(rows, "reward/mean", TREND_STEPS)
    if len(kl) == TREND_STEPS:
        kl_trend = correlation_with_step(kl)
        if kl_trend >= KL_RISING_R and kl[-1] > kl[0]:
            warnings.append(("kl_rising", KL_RISING.format(steps=TREND_STEPS, start=kl[0], end=kl[-1])))
        if len(reward) == TREND_STEPS and kl_trend >= DIVERGING_R and correlation_with_step(reward) <= -DIVERGING_R:
            warnings.append(("diverging", DIVERGING.format(steps=TREND_STEPS)))
    return warnings


def _last(rows: list[dict[str, Any]], key: str, count: int) -> list[float]:
    """The last `count` finite values of `key` (fewer if the run is younger, or a value is missing)."""
    values = [row.get(key) for row in rows[-count:]]
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def correlation_with_step(values: list[float]) -> float:
    """Pearson's r of values[i] with i: +1 for a steady rise, -1 for a steady fall, 0 for flat
    or noise. A constant series has no trend: 0.

    Example: [1, 2, 3] -> 1.0;  [3, 1, 2] -> -0.5;  [2, 2, 2] -> 0.0
    """
    count = len(values)
    if count < 2:
        return 0.0
    mean_index, mean_value = (count - 1) / 2, sum(values) / count
    covariance = sum((i - mean_index) * (v - mean_value) for i, v in enumerate(values))
    index_spread = math.sqrt(sum((i - mean_index) ** 2 for i in range(count)))
    value_spread = math.sqrt(sum((v - mean_value) ** 2 for v in values))
    if value_spread <= 1e-12 * max(1.0, abs(mean_value)):
        return 0.0
    return covariance / (index_spread * value_spread)
