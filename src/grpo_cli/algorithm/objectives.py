"""The policy term of the loss, one pure function per objective (`trainer.loss`), and the
importance ratio they share (`trainer.importance_sampling_level`). losses.grpo_loss adds the KL
term and aggregates; docs/ALGORITHM.md gives each formula with its source beside its key.

Each function returns the per-token objective to MAXIMIZE (the loss is its negative), [N, T] or
[N, 1] (a sequence-level ratio), and which tokens the clipping cut off from the gradient:

    clip   (GRPO paper eq. 3, PPO's surrogate)   min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
             with delta (INTELLECT-2, two-sided): the unclipped r becomes min(r, delta)
             with dual_clip = c (Ye et al. 2020, verl's clip_ratio_c): for A < 0, max(that, c A)
    cispo  (MiniMax-M1)                     sg(clip(r, ratio_min, ratio_max)) A log pi
    sapo   (SAPO, arXiv 2511.20347)          sigmoid(tau (r - 1)) 4 / tau A,
                                                  tau = tau_pos if A > 0 else tau_neg

    r = pi_theta / pi_old per token, or (GSPO, Zheng et al. 2025) per sequence:
    s_i = exp(1/|o_i| sum_t log(pi_theta(o_it) / pi_old(o_it))), the geometric mean of the
    token ratios, one value (and one clip) for the whole completion.

At r = 1 every objective has the same gradient, A grad log pi (SAPO's gate has slope
sigmoid'(0) 4 = 1 there): they differ only once the policy has moved from pi_old, that is
from the second pass over a rollout (num_iterations > 1) or under a sampler's mismatch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from grpo_cli.config import IMPORTANCE_SAMPLING_LEVELS, OBJECTIVES

if TYPE_CHECKING:  # losses imports this module
    from grpo_cli.algorithm.losses import LossSettings


class PolicyTerm(NamedTuple):
    objective: torch.Tensor  # [N, T] (or [N, 1], broadcast over T) to maximize
    clipped: torch.Tensor  # [N, T] or [N, 1] bool: where clipping stopped the ratio's gradient
    ratio: torch.Tensor  # [N, T] or [N, 1] r (with grad), for the KL's importance correction


def importance_ratio(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    """token: r_it = exp(logp_it - old_it), [N, T]. sequence (GSPO): s_i = exp(mean over the
    completion's masked tokens of logp - old), [N, 1]; an empty completion gets s = 1.
    Example: token log-ratios [log 2, log 0.5, (masked) 7] -> s = exp((log 2 + log 0.5) / 2) = 1."""
    log_ratio = log_probs - old_log_probs
    if level == "token":
        return torch.exp(log_ratio)
    if level == "sequence":
        weights = mask.to(log_ratio.dtype)
        mean = (log_ratio * weights).sum(dim=1, keepdim=True) / weights.sum(dim=1, keepdim=True).clamp(min=1.0)
        return torch.exp(mean)
    raise ValueError(f"unknown importance sampling level {level!r}; one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)}")


def clip_objective(ratio: torch.Tensor, advantages: torch.Tensor, settings: LossSettings) -> PolicyTerm:
    """PPO's clipped surrogate (the paper's), with INTELLECT-2's delta and dual-clip as options.

    Example, A = -1, eps 0.2: r = 4 -> min(-4, -1.2) = -4; with delta = 3: min(-3, -1.2) = -3
    (no gradient: the ratio is past delta); with dual_clip = 3 instead: max(-4, -3) = -3 (none
    either). r = 1.5, A = 1: min(1.5, 1.2) = 1.2, clipped."""
    capped = ratio if settings.delta is None else torch.clamp(ratio, max=settings.delta)
    unclipped = capped * advantages
    clipped = torch.clamp(ratio, 1.0 - settings.clip_eps, 1.0 + settings.clip_eps_high) * advantages
    objective = torch.minimum(unclipped, clipped)
    stopped = clipped < unclipped  # the min took the clipped (constant) branch
    if settings.delta is not None:
        stopped = stopped | (ratio > settings.delta)
    if settings.dual_clip is not None:
        floor = settings.dual_clip * advantages  # below the objective only where A < 0
        dual = (advantages < 0) & (floor > objective)
        objective = torch.where(dual, floor, objective)
        stopped = stopped | dual
    return PolicyTerm(objective, stopped, ratio)


def cispo_objective(
    ratio: torch.Tensor, advantages: torch.Tensor, log_probs: torch.Tensor, settings: LossSettings
) -> PolicyTerm:
    """CISPO: the clipped ratio is a constant weight (stop-gradient) on A log pi, so every token
    keeps its gradient, weighed by at most ratio_max. Example: r = 7, A = 1, ratio_max 5:
    objective 5 log pi, gradient 5 grad log pi (PPO's clip would give it none)."""
    weight = torch.clamp(ratio.detach(), min=settings.cispo_ratio_min, max=settings.cispo_ratio_max)
    stopped = ratio.detach() > settings.cispo_ratio_max
    if settings.cispo_ratio_min is not None:
        stopped = stopped | (ratio.detach() < settings.cispo_ratio_min)
    return PolicyTerm(weight * advantages * log_probs, stopped, ratio)


def sapo_objective(ratio: torch.Tensor, advantages: torch.Tensor, settings: LossSettings) -> PolicyTerm:
    """SAPO: a smooth gate in place of the hard clip; its slope sigmoid(tau (r - 1)) (1 - ...) 4
    is 1 at r = 1 and falls off on both sides, faster for the larger tau (negative advantages by
    default). Example: tau = 1, r = 1: sigmoid(0) 4 = 2, objective 2 A, d/dr = 1."""
    temperature = torch.where(
        advantages > 0,
        torch.as_tensor(settings.sapo_temperature_pos, dtype=ratio.dtype),
        torch.as_tensor(settings.sapo_temperature_neg, dtype=ratio.dtype),
    )
    gate = torch.sigmoid(temperature * (ratio - 1.0)) * 4.0 / temperature
    return PolicyTerm(gate * advantages, torch.zeros_like(gate, dtype=torch.bool), ratio)


def policy_objective(
    log_probs: torch.Tensor,  # [N, T] with grad
    old_log_probs: torch.Tensor,  # [N, T] no grad (equal to log_probs outside the mask)
    advantages: torch.Tensor,  # [N, 1]
    mask: torch.Tensor,  # [N, T]
    settings: LossSettings,
) -> PolicyTerm:
    """The selected objective at the selected importance-sampling level."""
    ratio = importance_ratio(log_probs, old_log_probs, mask, settings.importance_sampling_level)
    if settings.loss == "clip":
        return clip_objective(ratio, advantages, settings)
    if settings.loss == "cispo":
        return cispo_objective(ratio, advantages, log_probs, settings)
    if settings.loss == "sapo":
        return sapo_objective(ratio, advantages, settings)
    raise ValueError(f"unknown trainer.loss {settings.loss!r}; one of {', '.join(OBJECTIVES)}")
