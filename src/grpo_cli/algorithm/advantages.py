"""Stage 4, rewards -> advantages: pure tensor functions, no model, no config.

GRPO (DeepSeekMath, 2024), outcome supervision: each completion's reward is normalized within
its own prompt's group, and the result is the advantage of every token of that completion:

    grpo       A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)
    rloo       A_i = r_i - mean(r_j, j != i) = G / (G - 1) * (r_i - mean)     (Ahmadian et al. 2024)
    dr_grpo    A_i = r_i - mean(r_1..r_G)                                     (Liu et al. 2025)
    batch_std  A_i = (r_i - mean(r_1..r_G)) / (std of all B*G rewards + eps)  (group mean, batch std)
    reinforce_baseline  c_i = r_i - mean(r_1..r_G);  A_i = c_i / (std of all B*G c + eps)
               (REINFORCE++-baseline, Hu et al. 2025, OpenRLHF's reinforce_baseline: the batch std
               of the centered rewards, so groups that differ in mean do not inflate it)

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
    elif mode == "reinforce_baseline":
        values = centered / (centered.std() + std_eps)
    else:
        raise ValueError(f"unknown advantage mode {mode!r}; one of {', '.join(ADVANTAGE_MODES)}")
    values = values.masked_fill(zero_std.unsqueeze(1), 0.0)
    return Advantages(values=values.reshape(-1), zero_std_groups=zero_std)
