"""Adaptive group size (sampler.adaptive): more samples per prompt while training is stalled.

A group whose G rewards are all equal gives no advantage and no gradient. When a run stalls
(the mean reward has not improved for `patience` steps, or most groups have been zero-std over
those steps), sampling more completions per prompt makes a group with one success among many
failures (or the reverse) more likely. So the group size steps up from G to min(G x factor,
max_group_size) for `duration` steps and then returns to G; the stall counters restart then, so
a run that stays stalled is raised again only after another `patience` steps.

The state is a small dataclass saved in every checkpoint, so a resumed run raises and lowers G
at exactly the steps an unbroken one would.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from grpo_cli.config import AdaptiveGroupConfig


@dataclass
class AdaptiveGroupState:
    base_group_size: int
    group_size: int  # the group size of the next step
    best_reward: Optional[float] = None
    steps_without_improvement: int = 0
    zero_std_fractions: list[float] = field(default_factory=list)  # the last `patience` steps
    raised_until: Optional[int] = None  # the last step sampled at the raised size
    changes: list[dict[str, Any]] = field(default_factory=list)  # {step, group_size, reason}

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: Optional[dict[str, Any]], base_group_size: int) -> AdaptiveGroupState:
        return cls(**state) if state else cls(base_group_size, base_group_size)


def next_group_size(
    cfg: AdaptiveGroupConfig,
    state: AdaptiveGroupState,
    raised_size: int,
    step: int,
    reward_mean: float,
    zero_std_fraction: float,
) -> Optional[str]:
    """Record step `step`'s reward and zero-std fraction; set `state.group_size` for the next
    step. Returns why the group size changed, or None when it did not.

    Example (patience 2, duration 2, G 4 -> 8, reward flat at 0.5 from step 1): step 1 sets the
    best; steps 2 and 3 do not beat it, so after step 3 G becomes 8 for steps 4 and 5, and after
    step 5 it returns to 4.
    """
    if state.best_reward is None or reward_mean > state.best_reward + cfg.min_improvement:
        state.best_reward, state.steps_without_improvement = reward_mean, 0
    else:
        state.steps_without_improvement += 1
    state.zero_std_fractions = (state.zero_std_fractions + [zero_std_fraction])[-cfg.patience :]

    if state.raised_until is not None:
        if step < state.raised_until:
            return None
        state.raised_until = None
        return _change(
            state, step, state.base_group_size, f"back to {state.base_group_size} after {cfg.duration} raised steps"
        )
    mean_zero_std = sum(state.zero_std_fractions) / len(state.zero_std_fractions)
    if state.steps_without_improvement >= cfg.patience:
        reason = f"reward/mean has not improved for {cfg.patience} steps"
    elif len(state.zero_std_fractions) == cfg.patience and mean_zero_std > cfg.zero_std_fraction:
        reason = (
            f"{mean_zero_std:.0%} of groups were zero-std over the last {cfg.patience} steps "
            f"(above sampler.adaptive.zero_std_fraction={cfg.zero_std_fraction})"
        )
    else:
        return None
    state.raised_until = step + cfg.duration
    return _change(state, step, raised_size, f"raised to {raised_size} for {cfg.duration} steps: {reason}")


def _change(state: AdaptiveGroupState, step: int, group_size: int, reason: str) -> str:
    """Set the next step's group size and restart the stall counters (a fresh `patience`)."""
    state.group_size = group_size
    state.steps_without_improvement = 0
    state.zero_std_fractions = []
    state.changes.append({"step": step, "group_size": group_size, "reason": reason})
    return f"group size {reason}"
