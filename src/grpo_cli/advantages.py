"""Stage 4, advantage normalization: pure tensor functions, no model, no config.

GRPO (DeepSeekMath, 2024), outcome supervision: each completion's reward is normalized within
its own prompt's group, and the result is the advantage of every token of that completion:

    A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)

std is the sample standard deviation (divides by G - 1, torch's default, as in TRL), so for
G = 2 with rewards (1, 0): mean 0.5, std 0.7071, A = (+0.7071, -0.7071) (eps aside).
Groups whose std is below `std_threshold` (all G rewards equal) carry no signal: their
advantages are set to exactly 0 and they are counted, instead of dividing noise by ~eps.
"""

from __future__ import annotations

import torch

from grpo_cli.records import Advantages


def group_advantages(rewards: torch.Tensor, std_eps: float, std_threshold: float) -> Advantages:
    """rewards: [B, G] -> Advantages(values [B*G], zero_std_groups [B])."""
    mean = rewards.mean(dim=1, keepdim=True)  # [B, 1]
    std = rewards.std(dim=1, keepdim=True)  # [B, 1], sample std (G - 1)
    zero_std = std.squeeze(1) < std_threshold  # [B]
    values = (rewards - mean) / (std + std_eps)
    values = values.masked_fill(zero_std.unsqueeze(1), 0.0)
    return Advantages(values=values.reshape(-1), zero_std_groups=zero_std)
