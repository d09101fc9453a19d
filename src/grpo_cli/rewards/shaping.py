"""Stage 3's arithmetic, pure: the reward functions' scores [B, G] -> the total reward [B, G]
(weights, reward.clip, reward.normalize_each). docs/ALGORITHM.md, "Reward shaping before
advantages", gives the formulas."""

from __future__ import annotations

import torch


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
