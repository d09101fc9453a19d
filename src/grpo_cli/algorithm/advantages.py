"""Stage 4, rewards -> advantages: pure tensor functions, no model, no config.

GRPO (DeepSeekMath, 2024), outcome supervision: each completion's reward is normalized within
its own prompt's group, and the result is the advantage of every token of that completion:

    grpo       A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)
    rloo       A_i = r_i - mean(r_j, j != i) = G / (G - 1) * (r_i - mean)     (Ahmadian et al. 2024)
    dr_grpo    A_i = r_i - mean(r_1..r_G)                                     (Liu et al. 2025)
    batch_std  A_i = (r_i - mean(r_1..r_G)) / (std of all B*G rewards + eps)  (group mean, batch std)

std is the sample standard deviation (divides by G - 1; torch's default, as in TRL and verl, so
runs compare one to one with theirs), so for G = 2 with rewards (1, 0): mean 0.5, std 0.7071,
A = (+0.7071, -0.7071) (eps aside). Groups whose std is below `std_threshold` (all G rewards
equal) carry no signal: in every mode their advantages are exactly 0 and they are counted,
instead of dividing noise by ~eps.
"""

from __future__ import annotations

import torch

from grpo_cli.config import ADVANTAGE_MODES
from grpo_cli.records import Advantages


def group_advantages(rewards: torch.Tensor, std_eps: float, std_threshold: float, mode: str = "grpo") -> Advantages:
    """rewards: [B, G] -> Advantages(values [B*G], zero_std_groups [B])."""
    if not rewards.is_floating_point():
        rewards = rewards.float()
    group_size = rewards.shape[1]
    mean = rewards.mean(dim=1, keepdim=True)  # [B, 1]
    std = rewards.std(dim=1, keepdim=True)  # [B, 1], sample std (G - 1)
    zero_std = std.squeeze(1) < std_threshold  # [B]
    centered = rewards - mean
    if mode == "grpo":
        values = centered / (std + std_eps)
    elif mode == "rloo":
        values = centered * (group_size / (group_size - 1))
    elif mode == "dr_grpo":
        values = centered
    elif mode == "batch_std":
        values = centered / (rewards.std() + std_eps)
    else:
        raise ValueError(f"unknown advantage mode {mode!r}; one of {', '.join(ADVANTAGE_MODES)}")
    values = values.masked_fill(zero_std.unsqueeze(1), 0.0)
    return Advantages(values=values.reshape(-1), zero_std_groups=zero_std)


def combine_rewards(
    per_function: dict[str, torch.Tensor],
    weights: dict[str, float],
    clip: tuple[float, float] | None = None,
    normalize_each: bool = False,
    std_eps: float = 1e-4,
) -> torch.Tensor:
    """Weighted sum of the reward functions' scores, each [B, G] (NaN = the function had no
    opinion, counted as 0) -> [B, G].

    `clip`: each function's scores are clamped to [low, high] first, so one runaway function
    cannot swamp the others. `normalize_each`: each function's scores are z-scored within their
    group (mean/sample std over the group's non-NaN scores; a constant function gives 0) before
    weighting, so a reward on a 0..100 scale does not drown a 0..1 one. A NaN then counts as the
    group's mean (z = 0).
    Example, one group, f = (0, 10), g = (1, 0), weights 1: plain sum (1, 10);
    normalize_each: f -> (-0.7071, 0.7071), g -> (0.7071, -0.7071), sum (0, 0).
    """
    total = None
    for name, scores in per_function.items():
        scores = scores.float()
        if clip is not None:
            scores = scores.clamp(min=clip[0], max=clip[1])  # NaN stays NaN
        if normalize_each:
            scores = _group_z_scores(scores, std_eps)
        term = weights[name] * torch.nan_to_num(scores, nan=0.0)
        total = term if total is None else total + term
    return total


def _group_z_scores(scores: torch.Tensor, std_eps: float) -> torch.Tensor:
    """Z-score each row of [B, G] over its non-NaN entries (sample std); NaN stays NaN."""
    present = ~scores.isnan()
    count = present.sum(dim=1, keepdim=True).clamp(min=1)
    filled = torch.where(present, scores, torch.zeros_like(scores))
    mean = filled.sum(dim=1, keepdim=True) / count
    squares = torch.where(present, (scores - mean).square(), torch.zeros_like(scores))
    std = (squares.sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    return (scores - mean) / (std + std_eps)
