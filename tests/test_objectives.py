"""The objectives beyond the paper's clip (grpo_cli.algorithm.objectives) against literal,
loop-by-loop transcriptions of their published formulas, in value and gradient (float64), on the
random step of test_objective.py; then small cases worked by hand.

    r_it = exp(logp_it - old_it)                          token level (the paper)
    s_i  = exp(1/|o_i| sum_t (logp_it - old_it))          sequence level (GSPO's s_i), for every t
    clip   f = min(min(r, delta) A, clip(r, 1 - eps_l, 1 + eps_h) A);  A < 0: max(f, c A)
           (GRPO eq. 3; delta: INTELLECT-2's two-sided clip; c: dual-clip PPO, Ye et al. 2020)
    cispo  f = sg(clip(r, r_min, r_max)) A logp           (MiniMax-M1's J_CISPO)
    sapo   f = sigmoid(tau (r - 1)) 4 / tau  A,  tau = tau_pos if A > 0 else tau_neg   (SAPO's gate)
    loss = -sum_i w_i sum_t m_it (k_it f_it - beta KL_it + c k_it H_it)   w_i as in test_objective.py
    entropy controls: c = entropy_coef (the bonus), k_it = 1 if H_it >= the (1 - q) quantile of
    the masked H (linear interpolation between order statistics), else 0; k = 1 when q = 1
    ("Beyond the 80/20 rule": the policy term on the high-entropy tokens, the KL on all)

The expected values are never computed with the function under test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from grpo_cli.algorithm.advantages import group_advantages
from grpo_cli.algorithm.losses import LossDenominators, LossSettings, grpo_loss
from grpo_cli.algorithm.objectives import importance_ratio
from test_objective import (
    BETA,
    F64,
    MAX_NEW_TOKENS,
    STD_EPS,
    STD_THRESHOLD,
    one_token_loss,
    paper_clip,
    paper_kl,
    random_step,
)


def paper_quantile(values: list[float], level: float) -> float:
    """The `level` quantile of `values` by linear interpolation between the sorted values (numpy's
    default, "type 7"): position (n - 1) * level."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * level
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def paper_variant(log_probs, old, ref, advantages, mask, settings: dict, aggregation: str, entropy=None):
    """-J by explicit loops for one objective; returns (loss, tokens whose ratio's gradient a clip stopped)."""
    num_sequences, length = log_probs.shape
    total_tokens = int(mask.sum())
    quantile = settings.get("top_q", 1.0)
    coef = settings.get("entropy_coef", 0.0)
    if quantile < 1.0:
        masked = [entropy[i, t].item() for i in range(num_sequences) for t in range(length) if mask[i, t]]
        threshold = paper_quantile(masked, 1.0 - quantile)
    objective = torch.zeros((), dtype=F64)
    stopped = 0
    for i in range(num_sequences):
        advantage = advantages[i]
        positions = [t for t in range(length) if mask[i, t]]
        if settings.get("level") == "sequence":
            mean_log_ratio = sum((log_probs[i, t] - old[i, t] for t in positions), torch.zeros((), dtype=F64))
            sequence_ratio = torch.exp(mean_log_ratio / max(len(positions), 1))
        row_sum = torch.zeros((), dtype=F64)
        for t in positions:
            rho = sequence_ratio if settings.get("level") == "sequence" else torch.exp(log_probs[i, t] - old[i, t])
            loss = settings.get("loss", "clip")
            if loss == "clip":
                delta = settings.get("delta")
                capped = torch.tensor(delta, dtype=F64) if delta is not None and rho > delta else rho
                unclipped = capped * advantage
                clipped = paper_clip(rho, 1 - settings["eps_low"], 1 + settings["eps_high"]) * advantage
                term = min(unclipped, clipped)
                cut = bool(clipped < unclipped) or capped is not rho
                dual = settings.get("dual_clip")
                if dual is not None and advantage < 0 and dual * advantage > term:
                    term, cut = torch.tensor(dual * advantage, dtype=F64), True
                stopped += cut and advantage != 0  # the metrics count by the sign of A
            elif loss == "cispo":
                weight = float(rho.detach())
                if settings["ratio_min"] is not None:
                    weight = max(weight, settings["ratio_min"])
                weight = min(weight, settings["ratio_max"])
                term = weight * advantage * log_probs[i, t]
            elif loss == "sapo":
                tau = settings["tau_pos"] if advantage > 0 else settings["tau_neg"]
                term = torch.sigmoid(tau * (rho - 1)) * 4 / tau * advantage
            else:
                raise AssertionError(loss)
            kept = quantile >= 1.0 or entropy[i, t].item() >= threshold
            if kept:
                row_sum = row_sum + term + (coef * entropy[i, t] if coef else 0.0)
            row_sum = row_sum - BETA * paper_kl(log_probs[i, t], ref[i, t], "k3")
        if aggregation == "sequence_mean":
            if positions:
                objective = objective + row_sum / len(positions) / num_sequences
        elif aggregation == "token_mean":
            objective = objective + row_sum / total_tokens
        else:
            raise AssertionError(aggregation)
    return -objective, stopped


def ours_settings(settings: dict, aggregation: str) -> LossSettings:
    return LossSettings(
        clip_eps=settings.get("eps_low", 0.2),
        clip_eps_high=settings.get("eps_high", 0.2),
        beta=BETA,
        aggregation=aggregation,
        loss=settings.get("loss", "clip"),
        importance_sampling_level=settings.get("level", "token"),
        delta=settings.get("delta"),
        dual_clip=settings.get("dual_clip"),
        cispo_ratio_min=settings.get("ratio_min"),
        cispo_ratio_max=settings.get("ratio_max", 5.0),
        sapo_temperature_pos=settings.get("tau_pos", 1.0),
        sapo_temperature_neg=settings.get("tau_neg", 1.05),
        entropy_coef=settings.get("entropy_coef", 0.0),
        top_entropy_quantile=settings.get("top_q", 1.0),
    )


@dataclass
class RandomStep:
    log_probs: torch.Tensor  # [N, T]
    old: torch.Tensor  # [N, T]
    ref: torch.Tensor  # [N, T]
    advantages: torch.Tensor  # [N]
    mask: torch.Tensor  # [N, T]
    entropy: torch.Tensor  # [N, T] the policy's entropies, from 0 to 4 nats
    entropy_grad: torch.Tensor | None = None  # d loss / d entropy (the bonus), once our loss ran


def ours_on_the_random_step(settings: dict, aggregation: str):
    """Our loss on test_objective's random step: (the step, loss, metrics, the log-prob leaf)."""
    rewards, log_probs, old, ref, mask = random_step()
    entropy = torch.rand(log_probs.shape, generator=torch.Generator().manual_seed(7), dtype=F64) * 4
    advantages = group_advantages(rewards, STD_EPS, STD_THRESHOLD).values
    step = LossDenominators(sequences=mask.shape[0], tokens=int(mask.sum()), max_new_tokens=MAX_NEW_TOKENS)
    leaf, entropy_leaf = log_probs.clone().requires_grad_(), entropy.clone().requires_grad_()
    ours = ours_settings(settings, aggregation)
    loss, metrics = grpo_loss(leaf, old, ref, advantages, mask, ours, step, entropy=entropy_leaf)
    loss.backward()
    grad = entropy_leaf.grad if entropy_leaf.grad is not None else torch.zeros_like(entropy)
    return RandomStep(log_probs, old, ref, advantages, mask, entropy, grad), loss, metrics, leaf


# old = logp + noise of std 0.3: token ratios from about 0.4 to 2.5. Each case sets its bounds
# inside that spread, so that every clip, cap and gate is exercised (checked below).
CASES = {
    "delta": dict(eps_low=0.2, eps_high=0.28, delta=1.5),
    "dual_clip": dict(eps_low=0.2, eps_high=0.2, dual_clip=1.4),
    "delta+dual_clip": dict(eps_low=0.2, eps_high=0.2, delta=1.6, dual_clip=1.3),
    "gspo": dict(level="sequence", eps_low=0.02, eps_high=0.03),
    "gspo+dual_clip": dict(level="sequence", eps_low=0.02, eps_high=0.03, dual_clip=1.02),
    "cispo": dict(loss="cispo", ratio_min=None, ratio_max=1.3),
    "cispo-both-bounds": dict(loss="cispo", ratio_min=0.8, ratio_max=1.3),
    "cispo-sequence": dict(loss="cispo", level="sequence", ratio_min=0.98, ratio_max=1.02),
    "sapo": dict(loss="sapo", tau_pos=1.0, tau_neg=1.05),
    "sapo-steep": dict(loss="sapo", tau_pos=3.0, tau_neg=8.0),
    "sapo-sequence": dict(loss="sapo", level="sequence", tau_pos=1.0, tau_neg=1.05),
    "entropy bonus": dict(eps_low=0.2, eps_high=0.2, entropy_coef=0.01),
    "top 20% by entropy": dict(eps_low=0.2, eps_high=0.28, top_q=0.2),
    "top 50% by entropy, a bonus on them, cispo": dict(
        loss="cispo", ratio_min=None, ratio_max=1.3, top_q=0.5, entropy_coef=0.05
    ),
}


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean"])
@pytest.mark.parametrize("case", list(CASES))
def test_each_objective_equals_its_literal_formula_in_value_and_gradient(case, aggregation):
    settings = CASES[case]
    step, ours, metrics, ours_input = ours_on_the_random_step(settings, aggregation)
    log_probs, old, ref, advantages, mask = step.log_probs, step.old, step.ref, step.advantages, step.mask
    paper_input, paper_entropy = log_probs.clone().requires_grad_(), step.entropy.clone().requires_grad_()
    paper, stopped = paper_variant(
        paper_input, old, ref, advantages.tolist(), mask, settings, aggregation, paper_entropy
    )
    paper.backward()

    assert torch.allclose(ours, paper, atol=1e-10), (ours.item(), paper.item())
    assert torch.allclose(ours_input.grad, paper_input.grad, atol=1e-10)
    paper_entropy_grad = paper_entropy.grad if paper_entropy.grad is not None else torch.zeros_like(step.entropy)
    assert torch.allclose(step.entropy_grad, paper_entropy_grad, atol=1e-12)
    if settings.get("entropy_coef"):
        assert step.entropy_grad.abs().sum() > 0
    if settings.get("top_q", 1.0) < 1.0:  # the mask keeps about q of the loss tokens, and no other
        kept = metrics["entropy_kept"].item() / mask.sum().item()
        assert abs(kept - settings["top_q"]) < 0.05, kept
    assert torch.equal(ours_input.grad[mask == 0], torch.zeros(int((mask == 0).sum()), dtype=F64))
    if settings.get("loss", "clip") == "clip":
        assert stopped > 0  # the data reach the clip, or the comparison would not test it
        assert metrics["clipped_high"].item() + metrics["clipped_low"].item() == stopped


def test_the_cases_reach_every_bound_they_set():
    """Not vacuous: on the random step the capped, dual-clipped and gated tokens exist."""
    _, log_probs, old, _, mask = random_step()
    tokens = mask.bool()
    token_ratio = importance_ratio(log_probs, old, mask, "token")[tokens]
    sequence_ratio = importance_ratio(log_probs, old, mask, "sequence").squeeze(1)[mask.sum(dim=1) > 0]
    assert (token_ratio > 1.6).any() and (token_ratio > 1.3).any() and (token_ratio < 0.8).any()
    assert (sequence_ratio > 1.03).any() and (sequence_ratio < 0.98).any()  # gspo's and cispo-sequence's bounds


def test_the_objectives_differ_from_each_other_on_this_step():
    """Each case changes the loss against the paper's clip (with its eps) on the random step."""
    losses = {}
    for case, settings in {"paper": dict(eps_low=0.2, eps_high=0.28), **CASES}.items():
        losses[case] = ours_on_the_random_step(settings, "token_mean")[1].detach()
    assert len({round(float(loss), 9) for loss in losses.values()}) == len(losses), losses


# ---------------------------------------------------------------- worked by hand


def one_token(rho: float, advantage: float, **settings):
    """One sequence of one token, no KL: (loss, d loss / d logp, clipped_low)."""
    loss, grad, _, clipped_low = one_token_loss(rho, advantage, **settings)
    return loss, grad, clipped_low


def test_delta_caps_a_negative_advantage_tokens_huge_ratio():
    # r = 4, A = -1: the paper's min(4 * -1, 1.2 * -1) = -4 -> loss 4, gradient -A r = 4 (it grows with r)
    assert one_token(4.0, -1.0) == pytest.approx((4.0, 4.0, 0))
    # delta = 3: min(min(4, 3) * -1, -1.2) = -3 -> loss 3, a constant: gradient 0, counted as clipped
    assert one_token(4.0, -1.0, delta=3.0) == pytest.approx((3.0, 0.0, 1))
    # r = 2 < delta: untouched, loss 2, gradient 2
    assert one_token(2.0, -1.0, delta=3.0) == pytest.approx((2.0, 2.0, 0))


def test_dual_clip_bounds_a_negative_advantage_tokens_loss_at_c_times_minus_a():
    # r = 4, A = -1, c = 3: max(min(-4, -1.2), 3 * -1) = -3 -> loss 3, gradient 0
    assert one_token(4.0, -1.0, dual_clip=3.0) == pytest.approx((3.0, 0.0, 1))
    # r = 2, A = -1: max(-2, -3) = -2 -> loss 2, gradient 2 (below c nothing changes)
    assert one_token(2.0, -1.0, dual_clip=3.0) == pytest.approx((2.0, 2.0, 0))
    # A > 0 is never dual-clipped: r = 4, A = 1: min(4, 1.2) = 1.2 -> loss -1.2
    assert one_token(4.0, 1.0, dual_clip=3.0)[0] == pytest.approx(-1.2)


def test_cispo_keeps_the_gradient_of_a_token_that_ppo_clips():
    # r = 7, A = 1, r_max = 5: objective sg(5) * 1 * log 7 -> loss -5 log 7 = -9.729551;
    # gradient -5 (PPO's clip gives this token none)
    loss, grad, _ = one_token(7.0, 1.0, loss="cispo", cispo_ratio_max=5.0)
    assert (loss, grad) == pytest.approx((-5 * math.log(7), -5.0))
    assert one_token(7.0, 1.0)[1] == 0.0
    # r = 0.5, A = -1, bound r_min = 0.8: weight 0.8: loss -(0.8 * -1 * log 0.5) = -0.554518, gradient 0.8
    loss, grad, _ = one_token(0.5, -1.0, loss="cispo", cispo_ratio_min=0.8)
    assert (loss, grad) == pytest.approx((0.8 * math.log(0.5), 0.8))


def test_sapo_gate_has_slope_one_at_ratio_one_and_falls_off_asymmetrically():
    # r = 1, A = 1, tau 1: f = sigmoid(0) * 4 / 1 = 2 -> loss -2; d f / d logp = r sigmoid' 4 = 0.25 * 4 = 1
    assert one_token(1.0, 1.0, loss="sapo")[:2] == pytest.approx((-2.0, -1.0))
    # r = 2, A = 1, tau 1: f = sigmoid(1) * 4 = 2.924234; d/dlogp = r * sigmoid(1)(1 - sigmoid(1)) * 4 = 2 * 0.196612 * 4
    loss, grad, _ = one_token(2.0, 1.0, loss="sapo")
    assert (loss, grad) == pytest.approx((-2.924234, -2 * 0.196612 * 4), abs=1e-6)
    # A = -1 with tau_neg 2: f = sigmoid(2 * 1) * 4 / 2 * -1 = -1.761594; slope 2 * 4 * sig(2)(1 - sig(2)) / 2 * ... :
    # d/dlogp (-f) = r * sigmoid'(tau (r - 1)) * tau * 4 / tau = 2 * 0.104994 * 4 = 0.839949
    loss, grad, _ = one_token(2.0, -1.0, loss="sapo", sapo_temperature_neg=2.0)
    assert (loss, grad) == pytest.approx((1.761594, 0.839949), abs=1e-6)


def test_sequence_ratio_is_the_geometric_mean_over_the_completion():
    # token log-ratios log 2, log 0.5 and a masked 7: s = exp((log 2 + log 0.5) / 2) = 1
    log_probs = torch.tensor([[math.log(2), math.log(0.5), 7.0], [math.log(4), 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    ratio = importance_ratio(log_probs, torch.zeros_like(log_probs), mask, "sequence")
    assert ratio.shape == (2, 1)
    assert ratio.squeeze(1).tolist() == pytest.approx([1.0, 4.0])
    # an empty completion gets s = 1
    assert importance_ratio(log_probs, torch.zeros_like(log_probs), torch.zeros(2, 3), "sequence").tolist() == [
        [1.0],
        [1.0],
    ]
