"""The collapse guard (trainer.guard): the troubleshooting table of a GRPO run, automated.

Each step, before its checkpoint is written, the guard looks at the step's metrics:
- the loss or the gradient norm is NaN/inf (the step itself was already skipped by update.py),
- the mean of reward/mean over the last `window` steps fell more than `reward_drop` below the
  best such mean of the run,
- the mean per-token KL to the reference exceeds `max_kl`.
On any of them the run rolls back: the policy weights and optimizer state of the last good
checkpoint are loaded (for a reward drop, the newest one at or before the best window), beta is
multiplied by `beta_factor` (a too-small KL coefficient is the usual cause of a drift or a
collapse) and the learning rate by `lr_factor`, and training continues with the next step (the
step counter and the data order go on; only the weights go back). After `max_rollbacks`
rollbacks the next trigger stops the run with a report of every rollback.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from grpo_cli.checkpoint import complete_checkpoints, read_meta
from grpo_cli.config import ConfigError, GuardConfig


class GuardStop(ConfigError):
    """The guard ran out of rollbacks: the run stops with its report (exit code 2)."""


@dataclass
class GuardState:
    """What the guard carries from step to step; saved in every checkpoint (exact resume)."""

    rollbacks: list[dict[str, Any]] = field(default_factory=list)  # {step, reason, checkpoint}
    beta_scale: float = 1.0
    lr_scale: float = 1.0
    best_reward: Optional[float] = None  # best windowed mean of reward/mean
    best_step: int = 0  # the last step of that window
    recent: list[float] = field(default_factory=list)  # reward/mean of the last `window` steps

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: Optional[dict[str, Any]]) -> GuardState:
        return cls(**state) if state else cls()


def rollback_reason(guard: GuardConfig, state: GuardState, step: int, metrics: dict[str, Any]) -> Optional[str]:
    """Why this step calls for a rollback, or None. Updates the reward window in `state`."""
    loss, grad_norm = metrics.get("loss"), metrics.get("grad_norm")
    if metrics.get("skipped_updates") or not _finite(loss) or not _finite(grad_norm):
        return f"the loss or the gradient was not finite at step {step} (loss {loss}, grad norm {grad_norm})"
    kl = metrics.get("kl")
    if kl is not None and kl > guard.max_kl:
        return f"KL {kl:.4g} at step {step} exceeded trainer.guard.max_kl={guard.max_kl}"
    state.recent = (state.recent + [float(metrics["reward/mean"])])[-guard.window :]
    if len(state.recent) < guard.window:
        return None
    windowed = sum(state.recent) / len(state.recent)
    if state.best_reward is None or windowed > state.best_reward:
        state.best_reward, state.best_step = windowed, step
        return None
    if state.best_reward - windowed > guard.reward_drop:
        return (
            f"the mean reward of the last {guard.window} steps fell to {windowed:.4g} at step {step}, "
            f"more than trainer.guard.reward_drop={guard.reward_drop} below its best "
            f"{state.best_reward:.4g} (step {state.best_step})"
        )
    return None


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def rollback_target(output_dir: Path, state: GuardState, reward_drop: bool) -> Optional[Path]:
    """The last good checkpoint: for a reward drop the newest at or before the best window's
    end, else (or when there is none such) the newest."""
    found = complete_checkpoints(output_dir)
    if reward_drop:
        before_peak = [path for path in found if read_meta(path).get("step", 0) <= state.best_step]
        if before_peak:
            return before_peak[-1]
    return found[-1] if found else None


def roll_back(
    guard: GuardConfig,
    state: GuardState,
    step: int,
    reason: str,
    output_dir: Path,
    restore_weights: Callable[[Path], None],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> Path:
    """Load the last good checkpoint's weights and optimizer state (`restore_weights`, which is
    TrainState's), raise beta, lower the LR. Raises GuardStop when the rollbacks are used up or
    there is nothing to roll back to."""
    target = rollback_target(output_dir, state, reward_drop="reward" in reason)
    if len(state.rollbacks) >= guard.max_rollbacks or target is None:
        why = (
            "no checkpoint to roll back to (set trainer.checkpoint_every)"
            if target is None
            else f"trainer.guard.max_rollbacks={guard.max_rollbacks} rollbacks are used up"
        )
        raise GuardStop(report(state, f"Stopped at step {step}: {reason}; {why}."))
    current_lrs = scheduler.get_last_lr()
    restore_weights(target)  # the weights and the Adam moments of then
    # The schedule goes on from now (not from the checkpoint's step), lowered by lr_factor for good.
    for group, lr in zip(optimizer.param_groups, current_lrs):
        group["lr"] = lr * guard.lr_factor
    scheduler.base_lrs = [lr * guard.lr_factor for lr in scheduler.base_lrs]
    state.rollbacks.append({"step": step, "reason": reason, "checkpoint": str(target)})
    state.beta_scale *= guard.beta_factor
    state.lr_scale *= guard.lr_factor
    state.recent = []  # measure the drop afresh from the restored weights
    return target


def report(state: GuardState, headline: str) -> str:
    lines = [headline, "The guard's rollbacks in this run:"]
    lines += [
        f"  step {event['step']}: {event['reason']} -> rolled back to {event['checkpoint']}"
        for event in state.rollbacks
    ] or ["  none"]
    lines.append(
        f"beta is now x{state.beta_scale:g}, the learning rate x{state.lr_scale:g}. Look at "
        "metrics.jsonl (reward/mean, kl, grad_norm) around these steps; raise trainer.beta, "
        "lower optimizer.lr, or resume from an earlier checkpoint with trainer.resume=PATH."
    )
    return "\n".join(lines)
