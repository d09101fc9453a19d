"""The loss against a literal, readable transcription of the GRPO objective (DeepSeekMath eq. 3
with the DAPO / Dr. GRPO / RLOO variants selected by keys), written with explicit loops over
sequences i and tokens t so that each line can be read against the paper. The vectorized code in
grpo_cli.algorithm.losses / grpo_cli.algorithm.advantages must agree with it in value and in gradient (float64).

    J = sum_i w_i sum_t m_it [ min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i)
                               - beta KL_it ]
    rho_it = exp(logp_it - old_it)
    w_i = 1 / (N |o_i|)  sequence_mean (GRPO)    1 / sum_jt m_jt  token_mean (DAPO)
          1 / (N L_max)  constant (Dr. GRPO)      loss = -J

The expected values are never computed with the function under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from grpo_cli.algorithm.advantages import group_advantages
from grpo_cli.algorithm.losses import (
    LossDenominators,
    LossSettings,
    aggregate,
    grpo_loss,
    kl_estimate,
    token_entropy,
    token_log_probs,
)
from grpo_cli.config import BetaSchedule

F64 = torch.float64
STD_EPS = 1e-4
STD_THRESHOLD = 1e-4
BETA = 0.04


# ---------------------------------------------------------------- the transcription (reference)


def paper_mean(values: list[float]) -> float:
    return sum(values) / len(values)


def paper_sample_std(values: list[float]) -> float:
    """sqrt(sum (x - mean)^2 / (n - 1)): the sample std, as TRL/verl and docs/ALGORITHM.md use."""
    mean = paper_mean(values)
    return math.sqrt(sum((x - mean) ** 2 for x in values) / (len(values) - 1))


def paper_advantages(rewards: list[list[float]], mode: str) -> list[float]:
    """One advantage per completion, groups flattened row by row, each formula as published."""
    all_rewards = [r for group in rewards for r in group]
    advantages = []
    for group in rewards:
        group_size = len(group)
        mean = paper_mean(group)
        std = paper_sample_std(group)
        for i, reward in enumerate(group):
            if std < STD_THRESHOLD:
                # no spread in the group: no signal, in every mode
                advantages.append(0.0)
            elif mode == "grpo":
                advantages.append((reward - mean) / (std + STD_EPS))
            elif mode == "rloo":
                # leave-one-out baseline: the mean of the OTHER G - 1 rewards of the group
                others = [group[j] for j in range(group_size) if j != i]
                advantages.append(reward - paper_mean(others))
            elif mode == "dr_grpo":
                advantages.append(reward - mean)
            elif mode == "batch_std":
                advantages.append((reward - mean) / (paper_sample_std(all_rewards) + STD_EPS))
            elif mode == "reinforce_baseline":
                # REINFORCE++-baseline: the group's mean, then the sample std of every completion's
                # centered reward in the batch (uninformative groups included: they are 0)
                centered = [r - paper_mean(g) for g in rewards for r in g]
                advantages.append((reward - mean) / (paper_sample_std(centered) + STD_EPS))
            else:
                raise AssertionError(mode)
    return advantages


def paper_clip(value: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """clip(x, low, high). Outside the range the bound itself is returned: a constant, no gradient."""
    if value < low:
        return torch.tensor(low, dtype=F64)
    if value > high:
        return torch.tensor(high, dtype=F64)
    return value


def paper_kl(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref) ** 2
    if estimator == "k3":
        return torch.exp(ref - logp) - (ref - logp) - 1
    raise AssertionError(estimator)


def paper_objective(
    log_probs,
    old_log_probs,
    ref_log_probs,
    advantages,
    mask,
    *,
    clip_eps_low,
    clip_eps_high,
    beta,
    kl_estimator,
    aggregation,
    max_new_tokens,
):
    """-J by explicit loops; returns (loss, tokens clipped on the high side, on the low side)."""
    num_sequences, length = log_probs.shape
    total_tokens = int(mask.sum())
    objective = torch.zeros((), dtype=F64)
    clipped_high = clipped_low = 0
    for i in range(num_sequences):
        advantage = advantages[i]
        sequence_length = int(sum(int(mask[i, t]) for t in range(length)))  # |o_i|
        row_sum = torch.zeros((), dtype=F64)
        for t in range(length):
            if not mask[i, t]:
                continue
            rho = torch.exp(log_probs[i, t] - old_log_probs[i, t])
            unclipped = rho * advantage
            clipped = paper_clip(rho, 1 - clip_eps_low, 1 + clip_eps_high) * advantage
            surrogate = min(unclipped, clipped)
            if clipped < unclipped:  # the min took the constant branch
                if advantage > 0:
                    clipped_high += 1
                else:
                    clipped_low += 1
            kl = paper_kl(log_probs[i, t], ref_log_probs[i, t], kl_estimator)
            row_sum = row_sum + surrogate - beta * kl
        if aggregation == "sequence_mean":
            if sequence_length > 0:  # an empty completion contributes 0 but still counts in N
                objective = objective + row_sum / sequence_length / num_sequences
        elif aggregation == "token_mean":
            objective = objective + row_sum / total_tokens
        elif aggregation == "constant":
            objective = objective + row_sum / (num_sequences * max_new_tokens)
        else:
            raise AssertionError(aggregation)
    return -objective, clipped_high, clipped_low


# ---------------------------------------------------------------- a random step to compare on

GROUPS, GROUP_SIZE, LENGTH, MAX_NEW_TOKENS = 3, 4, 7, 9  # MAX_NEW_TOKENS != LENGTH on purpose
EMPTY_ROW = 3


def random_step(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    rows = GROUPS * GROUP_SIZE

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=F64)

    rewards = torch.stack(
        [
            normal(GROUP_SIZE),  # continuous rewards
            torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=F64),  # a correct/incorrect group
            torch.full((GROUP_SIZE,), 0.5, dtype=F64),  # no spread: A = 0 in every mode
        ]
    )
    log_probs = -torch.rand(rows, LENGTH, generator=generator, dtype=F64) * 3
    # old = logp + noise of std 0.3: rho = exp(-noise) lands outside [0.8, 1.28] on both sides
    old_log_probs = log_probs + 0.3 * normal(rows, LENGTH)
    ref_log_probs = log_probs + 0.5 * normal(rows, LENGTH)
    mask = (torch.rand(rows, LENGTH, generator=generator) < 0.7).long()
    mask[0] = 1  # one full row
    mask[EMPTY_ROW] = 0  # one fully masked row
    return rewards, log_probs, old_log_probs, ref_log_probs, mask


def ours_and_papers(aggregation, mode, kl_estimator, clip_eps_high, rows=None):
    rewards, log_probs, old, ref, mask = random_step()
    advantages = group_advantages(rewards, STD_EPS, STD_THRESHOLD, mode).values
    expected_advantages = paper_advantages(rewards.tolist(), mode)
    assert torch.allclose(advantages, torch.tensor(expected_advantages, dtype=F64), atol=1e-12)

    settings = LossSettings(
        clip_eps=0.2, clip_eps_high=clip_eps_high, beta=BETA, kl_estimator=kl_estimator, aggregation=aggregation
    )
    step = LossDenominators(sequences=mask.shape[0], tokens=int(mask.sum()), max_new_tokens=MAX_NEW_TOKENS)
    ours_input = log_probs.clone().requires_grad_()
    ours, metrics = grpo_loss(ours_input, old, ref, advantages, mask, settings, step)
    ours.backward()

    paper_input = log_probs.clone().requires_grad_()
    paper, clipped_high, clipped_low = paper_objective(
        paper_input,
        old,
        ref,
        expected_advantages,
        mask,
        clip_eps_low=0.2,
        clip_eps_high=clip_eps_high,
        beta=BETA,
        kl_estimator=kl_estimator,
        aggregation=aggregation,
        max_new_tokens=MAX_NEW_TOKENS,
    )
    paper.backward()
    return (ours, ours_input.grad, metrics), (paper, paper_input.grad, clipped_high, clipped_low)


CASES = [
    # every aggregation x every advantage mode, k3 (the paper's estimator), DAPO's clip-higher
    *[
        pytest.param(aggregation, mode, "k3", 0.28, id=f"{aggregation}-{mode}-k3-clip_high")
        for aggregation in ("sequence_mean", "token_mean", "constant")
        for mode in ("grpo", "rloo", "dr_grpo", "batch_std", "reinforce_baseline")
    ],
    # the other estimators with one aggregation
    *[
        pytest.param("sequence_mean", mode, estimator, 0.28, id=f"sequence_mean-{mode}-{estimator}")
        for estimator in ("k1", "k2")
        for mode in ("grpo", "rloo")
    ],
    pytest.param("token_mean", "dr_grpo", "k2", 0.28, id="token_mean-dr_grpo-k2"),
    # the paper's symmetric clip
    *[
        pytest.param(aggregation, "grpo", "k3", 0.2, id=f"{aggregation}-grpo-k3-symmetric")
        for aggregation in ("sequence_mean", "token_mean", "constant")
    ],
]


@pytest.mark.parametrize("aggregation, mode, kl_estimator, clip_eps_high", CASES)
def test_grpo_loss_equals_the_literal_objective_in_value_and_gradient(aggregation, mode, kl_estimator, clip_eps_high):
    (ours, ours_grad, metrics), (paper, paper_grad, clipped_high, clipped_low) = ours_and_papers(
        aggregation, mode, kl_estimator, clip_eps_high
    )
    # the data must exercise both clip bounds, or the comparison would not test the clipping
    assert clipped_high > 0 and clipped_low > 0
    assert torch.allclose(ours, paper, atol=1e-6), (ours.item(), paper.item())
    assert torch.allclose(ours_grad, paper_grad, atol=1e-6)
    # the empty row and the masked tokens get no gradient at all
    _, _, _, _, mask = random_step()
    assert torch.equal(ours_grad[mask == 0], torch.zeros(int((mask == 0).sum()), dtype=F64))
    assert metrics["clipped_high"].item() == clipped_high
    assert metrics["clipped_low"].item() == clipped_low


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean", "constant"])
def test_micro_batch_losses_and_gradients_add_up_to_the_step(aggregation):
    rewards, log_probs, old, ref, mask = random_step(seed=1)
    advantages = group_advantages(rewards, STD_EPS, STD_THRESHOLD, "grpo").values
    settings = LossSettings(clip_eps=0.2, clip_eps_high=0.28, beta=BETA, aggregation=aggregation)
    # every micro-batch divides by the WHOLE step's counts, not by its own
    step = LossDenominators(sequences=mask.shape[0], tokens=int(mask.sum()), max_new_tokens=MAX_NEW_TOKENS)

    full_input = log_probs.clone().requires_grad_()
    full, _ = grpo_loss(full_input, old, ref, advantages, mask, settings, step)
    full.backward()

    parts_input = log_probs.clone().requires_grad_()
    parts = sum(
        grpo_loss(parts_input[rows], old[rows], ref[rows], advantages[rows], mask[rows], settings, step)[0]
        for rows in (slice(0, 5), slice(5, 9), slice(9, 12))
    )  # uneven sizes on purpose
    parts.backward()

    paper, _, _ = paper_objective(
        log_probs,
        old,
        ref,
        paper_advantages(rewards.tolist(), "grpo"),
        mask,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        beta=BETA,
        kl_estimator="k3",
        aggregation=aggregation,
        max_new_tokens=MAX_NEW_TOKENS,
    )
    assert torch.allclose(parts, full, atol=1e-9)
    assert torch.allclose(full, paper, atol=1e-6)
    assert torch.allclose(parts_input.grad, full_input.grad, atol=1e-9)


# ---------------------------------------------------------------- hand-derived small cases


def one_token_loss(rho: float, advantage: float, clip_eps: float = 0.2, clip_eps_high: float = 0.2, **settings):
    """One sequence of one token (N = |o| = 1), no KL: (loss, d loss / d logp, clipped_high,
    clipped_low); with the default settings loss = -min(rho A, clip(rho) A)."""
    log_probs = torch.tensor([[math.log(rho)]], dtype=F64, requires_grad=True)
    loss, metrics = grpo_loss(
        log_probs,
        torch.zeros(1, 1, dtype=F64),
        None,
        torch.tensor([advantage], dtype=F64),
        torch.ones(1, 1),
        LossSettings(clip_eps, clip_eps_high, beta=0.0, **settings),
        LossDenominators(1, 1, 1),
    )
    loss.backward()
    return loss.item(), log_probs.grad.item(), metrics["clipped_high"].item(), metrics["clipped_low"].item()


def test_clip_higher_lets_a_positive_advantage_token_grow_past_the_symmetric_bound():
    # rho = 1.25, A = 2.
    # symmetric eps 0.2: clip(1.25) = 1.2; min(2.5, 2.4) = 2.4 -> loss -2.4, the constant branch: grad 0
    assert one_token_loss(1.25, 2.0, 0.2, 0.2) == pytest.approx((-2.4, 0.0, 1, 0))
    # eps_high 0.28: 1.25 < 1.28 is not clipped; loss -rho A = -2.5,
    # d loss / d logp = -A * d rho / d logp = -A rho = -2.5 (divided by |o| N = 1)
    assert one_token_loss(1.25, 2.0, 0.2, 0.28) == pytest.approx((-2.5, -2.5, 0, 0))


def test_the_lower_bound_uses_clip_eps_not_clip_eps_high():
    # rho = 0.75, A = -1, eps 0.2 / eps_high 0.28: lower bound 1 - 0.2 = 0.8 (1 - 0.28 = 0.72 would not clip)
    # min(-0.75, -0.8) = -0.8 -> loss 0.8, clipped on the low side, grad 0
    assert one_token_loss(0.75, -1.0, 0.2, 0.28) == pytest.approx((0.8, 0.0, 0, 1))
    # rho = 0.82 is inside [0.8, 1.28]: loss -(0.82 * -1) = 0.82, grad -A rho = 0.82
    assert one_token_loss(0.82, -1.0, 0.2, 0.28) == pytest.approx((0.82, 0.82, 0, 0))


def test_kl_estimators_by_hand():
    # logp = log 0.5, ref = log 0.25: logp - ref = log 2 = 0.693147
    # k1 = log 2 = 0.693147; k2 = (log 2)^2 / 2 = 0.480453 / 2 = 0.240227
    # k3 = e^(ref - logp) - (ref - logp) - 1 = 0.5 + 0.693147 - 1 = 0.193147
    logp, ref = torch.tensor([math.log(0.5)], dtype=F64), torch.tensor([math.log(0.25)], dtype=F64)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(0.693147, abs=1e-6)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.240227, abs=1e-6)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.193147, abs=1e-6)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(logp, ref, "k4")


@pytest.mark.parametrize("estimator, value", [("k1", 0.693147), ("k2", 0.240227), ("k3", 0.193147)])
def test_the_loss_adds_beta_times_the_chosen_estimator(estimator, value):
    # A = 0 leaves only the KL term: one token, loss = beta * k = 0.1 * value
    logp = torch.tensor([[math.log(0.5)]], dtype=F64)
    loss, metrics = grpo_loss(
        logp,
        logp,
        torch.tensor([[math.log(0.25)]], dtype=F64),
        torch.zeros(1, dtype=F64),
        torch.ones(1, 1),
        LossSettings(0.2, 0.2, beta=0.1, kl_estimator=estimator),
        LossDenominators(1, 1, 1),
    )
    assert loss.item() == pytest.approx(0.1 * value, abs=1e-7)
    assert metrics["kl_sum"].item() == pytest.approx(value, abs=1e-6)


def test_kl_importance_correction_weighs_the_kl_by_the_ratio():
    # A = 0 leaves beta * rho * k3. logp = log 0.5, old = log 0.4, ref = log 0.3:
    # rho = 1.25; k3 = 0.6 - log 0.6 - 1 = 0.110826; loss = 0.1 x 1.25 x 0.110826 = 0.0138532.
    # d/dlogp (rho k3) = rho k3 + rho (1 - e^(ref - logp)) = 0.138532 + 1.25 x 0.4 = 0.638532, x 0.1.
    logp = torch.tensor([[math.log(0.5)]], dtype=F64, requires_grad=True)
    old, ref = torch.tensor([[math.log(0.4)]], dtype=F64), torch.tensor([[math.log(0.3)]], dtype=F64)
    settings = LossSettings(0.2, 0.2, beta=0.1, kl_importance_correction=True)
    loss, metrics = grpo_loss(
        logp, old, ref, torch.zeros(1, dtype=F64), torch.ones(1, 1), settings, LossDenominators(1, 1, 1)
    )
    loss.backward()
    assert loss.item() == pytest.approx(0.1 * 1.25 * 0.110826, abs=1e-7)
    assert logp.grad.item() == pytest.approx(0.1 * 0.638532, abs=1e-7)
    assert metrics["kl_sum"].item() == pytest.approx(0.110826, abs=1e-6)  # the logged KL: the plain estimate


def test_kl_estimator_gradients_by_hand():
    # logp = log 0.5, ref = log 0.25.
    # k1 = logp - ref:                   d/dlogp = 1
    # k2 = (logp - ref)^2 / 2:           d/dlogp = logp - ref = log 2 = 0.693147
    # k3 = e^(ref - logp) - (ref - logp) - 1:  d/dlogp = -e^(ref - logp) + 1 = 1 - 0.5 = 0.5
    ref = torch.tensor([math.log(0.25)], dtype=F64)
    for estimator, expected in (("k1", 1.0), ("k2", math.log(2)), ("k3", 0.5)):
        logp = torch.tensor([math.log(0.5)], dtype=F64, requires_grad=True)
        kl_estimate(logp, ref, estimator).sum().backward()
        assert logp.grad.item() == pytest.approx(expected, abs=1e-9), estimator
    # k3's gradient is 0 where pi = ref (its minimum), and negative where pi < ref (pushes pi up)
    logp = torch.tensor([-1.0, -2.0], dtype=F64, requires_grad=True)
    kl_estimate(logp, torch.tensor([-1.0, -1.0], dtype=F64), "k3").sum().backward()
    # second: 1 - e^(-1 + 2) = 1 - e = -1.718282
    assert logp.grad.tolist() == pytest.approx([0.0, 1 - math.e])


def _on_policy_two_rows(aggregation: str, max_new_tokens: int = 4):
    """Rows of lengths 1 and 3, A = (1, -2), on policy (rho = 1), no KL: token (i, t) loses -A_i."""
    log_probs = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    loss, _ = grpo_loss(
        log_probs,
        log_probs.detach(),
        None,
        torch.tensor([1.0, -2.0], dtype=F64),
        mask,
        LossSettings(0.2, 0.2, beta=0.0, aggregation=aggregation),
        LossDenominators(sequences=2, tokens=4, max_new_tokens=max_new_tokens),
    )
    loss.backward()
    return loss.item(), log_probs.grad.tolist()


def test_sequence_mean_weighs_each_sequence_the_same():
    # per-token losses: row 0 (-1), row 1 (2, 2, 2). Row means -1 and 2, over N = 2: 0.5
    # gradient of a token: -A_i / (|o_i| N): row 0 -1/2, row 1 2/(3*2) = 1/3
    loss, grad = _on_policy_two_rows("sequence_mean")
    assert loss == pytest.approx(0.5)
    assert grad == [pytest.approx([-0.5, 0, 0]), pytest.approx([1 / 3] * 3)]


def test_token_mean_weighs_each_token_the_same():
    # (-1 + 2 + 2 + 2) / 4 tokens = 1.25; gradient -A_i / 4: row 0 -0.25, row 1 0.5
    loss, grad = _on_policy_two_rows("token_mean")
    assert loss == pytest.approx(1.25)
    assert grad == [pytest.approx([-0.25, 0, 0]), pytest.approx([0.5] * 3)]


def test_constant_aggregation_divides_by_sequences_times_max_new_tokens():
    # sum 5 over N * max_new_tokens = 2 * 4 = 8 -> 0.625; gradient -A_i / 8
    loss, grad = _on_policy_two_rows("constant", max_new_tokens=4)
    assert loss == pytest.approx(0.625)
    assert grad == [pytest.approx([-0.125, 0, 0]), pytest.approx([0.25] * 3)]
    # max_new_tokens 10, not the padded length 3: 5 / 20 = 0.25
    assert _on_policy_two_rows("constant", max_new_tokens=10)[0] == pytest.approx(0.25)


def test_aggregate_divides_by_the_step_counts_not_the_micro_batch_counts():
    per_token = torch.tensor([[4.0, 99.0, 99.0], [1.0, 2.0, 3.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    step = LossDenominators(sequences=5, tokens=10, max_new_tokens=8)
    # sequence_mean: (4/1 + 6/3) / 5 sequences in the step = 1.2
    assert aggregate(per_token, mask, "sequence_mean", step).item() == pytest.approx(1.2)
    # token_mean: (4 + 1 + 2 + 3) / 10 tokens in the step = 1.0
    assert aggregate(per_token, mask, "token_mean", step).item() == pytest.approx(1.0)
    # constant: 10 / (5 * 8) = 0.25
    assert aggregate(per_token, mask, "constant", step).item() == pytest.approx(0.25)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(per_token, mask, "sum", step)


def test_clip_metrics_count_each_side_over_masked_tokens_only():
    # eps 0.2 symmetric. Row 0, A = +1: rho 1.5 (clipped high), 0.5 (A > 0 below: min keeps rho), 1.0
    # Row 1, A = -1: rho 0.5 and 0.6 (clipped low), 1.5 (A < 0 above: min keeps rho),
    #                0.7 (would be clipped low, but masked out)
    # -> clipped_high 1, clipped_low 2
    rho = torch.tensor([[1.5, 0.5, 1.0, 1.0], [0.5, 0.6, 1.5, 0.7]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    _, metrics = grpo_loss(
        rho.log(),
        torch.zeros(2, 4, dtype=F64),
        None,
        torch.tensor([1.0, -1.0], dtype=F64),
        mask,
        LossSettings(0.2, 0.2, beta=0.0),
        LossDenominators(2, 6, 4),
    )
    assert metrics["clipped_high"].item() == 1
    assert metrics["clipped_low"].item() == 2
    assert metrics["tokens"].item() == 6
    # the largest |rho - 1| among the masked tokens: 0.5 (the masked 0.7 would give only 0.3 anyway)
    assert metrics["ratio_max_deviation"].item() == pytest.approx(0.5)


# ---------------------------------------------------------------- beta schedule


def test_linear_beta_schedule_tight_then_loose():
    schedule = BetaSchedule(0.05, 0.02, 100, "linear")
    # 0.05 + (0.02 - 0.05) * step / 100
    assert schedule.at(0) == pytest.approx(0.05)
    assert schedule.at(25) == pytest.approx(0.0425)
    assert schedule.at(50) == pytest.approx(0.035)
    assert schedule.at(100) == pytest.approx(0.02)
    assert schedule.at(500) == pytest.approx(0.02)
    assert schedule.peak == 0.05


def test_cosine_beta_schedule():
    schedule = BetaSchedule(0.05, 0.02, 100, "cosine")
    # progress p -> (1 - cos(pi p)) / 2; at p = 0.5 that is 0.5: 0.05 - 0.03 * 0.5 = 0.035
    assert schedule.at(50) == pytest.approx(0.035)
    # at p = 0.25: (1 - cos(pi/4)) / 2 = (1 - 0.707107) / 2 = 0.146447 -> 0.05 - 0.0043934 = 0.0456066
    assert schedule.at(25) == pytest.approx(0.05 - 0.03 * (1 - math.cos(math.pi * 0.25)) / 2)
    assert schedule.at(25) == pytest.approx(0.0456066, abs=1e-7)
    assert schedule.at(0) == pytest.approx(0.05)
    assert schedule.at(100) == pytest.approx(0.02)


def test_step_beta_schedule_switches_at_warmup():
    schedule = BetaSchedule(0.05, 0.02, 100, "step")
    assert schedule.at(0) == 0.05
    assert schedule.at(99) == 0.05
    assert schedule.at(100) == 0.02


def test_no_warmup_gives_end_from_the_first_step_and_a_constant_schedule_is_constant():
    assert BetaSchedule(0.05, 0.02).at(0) == 0.02
    for step in (0, 1, 50, 1000):
        assert BetaSchedule(0.04, 0.04).at(step) == pytest.approx(0.04)
        assert BetaSchedule(0.04, 0.04, 100, "cosine").at(step) == pytest.approx(0.04)
    # loose then tight also works: peak is the larger end
    assert BetaSchedule(0.02, 0.05, 10).peak == 0.05
    assert BetaSchedule(0.02, 0.05, 10).at(5) == pytest.approx(0.035)


# ---------------------------------------------------------------- chunked log-probs and entropy

ROWS_BATCH, ROWS_LENGTH, VOCAB = 2, 5, 11  # 10 rows: chunk 3 leaves a partial last chunk


def _logits_and_tokens(dtype: torch.dtype):
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(ROWS_BATCH, ROWS_LENGTH, VOCAB, generator=generator) * 3).to(dtype)
    tokens = torch.randint(0, VOCAB, (ROWS_BATCH, ROWS_LENGTH), generator=generator)
    weights = torch.randn(ROWS_BATCH, ROWS_LENGTH, generator=generator)  # an upstream gradient
    return logits, tokens, weights


@pytest.mark.parametrize("chunk_rows", [1, 3, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_log_probs_equal_log_softmax_gather_in_value_and_gradient(chunk_rows, dtype):
    logits, tokens, weights = _logits_and_tokens(dtype)
    # reference: plain autograd through log_softmax, in float32 on the very same (bf16-rounded) values
    reference_logits = logits.float().clone().requires_grad_()
    expected = torch.log_softmax(reference_logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    (expected * weights).sum().backward()

    ours_logits = logits.clone().requires_grad_()
    ours = token_log_probs(ours_logits, tokens, chunk_rows=chunk_rows)
    (ours * weights).sum().backward()

    assert ours.dtype == torch.float32  # bf16 logits are upcast, the result is not bf16
    assert torch.allclose(ours, expected.detach(), atol=1e-5)
    assert ours_logits.grad.dtype == dtype
    if dtype == torch.float32:
        assert torch.allclose(ours_logits.grad, reference_logits.grad, atol=1e-6)
    else:  # the gradient is handed back in bf16: equal up to bf16 rounding (8 mantissa bits)
        torch.testing.assert_close(ours_logits.grad.float(), reference_logits.grad, atol=1e-5, rtol=1e-2)


def test_token_log_probs_backward_passes_gradcheck_in_float64():
    # finite differences, independent of the hand-written backward
    logits, tokens, _ = _logits_and_tokens(F64)
    logits.requires_grad_()
    assert torch.autograd.gradcheck(lambda x: token_log_probs(x, tokens, chunk_rows=3), (logits,))


@pytest.mark.parametrize("chunk_rows", [1, 3, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_entropy_equals_minus_sum_p_log_p(chunk_rows, dtype):
    logits, _, _ = _logits_and_tokens(dtype)
    probabilities = torch.softmax(logits.double(), dim=-1)
    expected = -(probabilities * probabilities.log()).sum(dim=-1)
    ours = token_entropy(logits, chunk_rows=chunk_rows)
    assert ours.dtype == torch.float32 and not ours.requires_grad
    assert torch.allclose(ours.double(), expected, atol=1e-5)


class LargestFloat32Output(TorchDispatchMode):
    """Records the largest float32 tensor any aten op produces (forward and backward alike: the
    autograd engine carries the mode into backward, and ops inside autograd.Function run through
    the dispatcher like any other), and the names of the ops seen."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(func.overloadpacket.__name__)
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                self.largest = max(self.largest, value.numel())
        return out


def test_token_log_probs_memory_scales_with_chunk_times_vocab_not_batch_times_length():
    batch, length, vocab, chunk = 4, 16, 1000, 8
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(batch, length, vocab, generator=generator).bfloat16().requires_grad_()
    tokens = torch.randint(0, vocab, (batch, length), generator=generator)

    with LargestFloat32Output() as chunked:
        token_log_probs(logits, tokens, chunk_rows=chunk).sum().backward()
    # the backward was recorded too: softmax only runs there (the forward uses logsumexp)
    assert "_softmax" in chunked.ops and "scatter_add_" in chunked.ops
    assert 0 < chunked.largest <= chunk * vocab  # 8 rows x 1000, not 64 rows x 1000

    # the same recorder does see the naive path's full [4, 16, 1000] float32 copy: the test can fail
    with LargestFloat32Output() as naive:
        torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).sum().backward()
    assert naive.largest == batch * length * vocab


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_log_probs_and_entropy_at_the_sampling_temperature(temperature):
    # pi = softmax(logits / T): the value and gradient of log pi(token) must match autograd
    # through log_softmax(logits / T); the entropy is that of the same distribution. The logits
    # carry one more position than the tokens (the model's last), which must be ignored.
    torch.manual_seed(3)
    logits = torch.randn(2, 4, 11, dtype=F64, requires_grad=True)
    tokens = torch.randint(0, 11, (2, 3))
    ours = token_log_probs(logits, tokens, temperature, chunk_rows=2)
    weights = torch.randn(2, 3, dtype=F64)
    (ours * weights).sum().backward()
    ours_grad = logits.grad.clone()
    logits.grad = None
    reference = torch.log_softmax(logits[:, :3] / temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    (reference * weights).sum().backward()
    assert torch.allclose(ours, reference, atol=1e-12)
    assert torch.allclose(ours_grad, logits.grad, atol=1e-12)
    assert torch.equal(ours_grad[:, 3], torch.zeros(2, 11, dtype=F64))
    probs = torch.softmax(logits.detach()[:, :3] / temperature, dim=-1)
    entropy = -(probs * probs.log()).sum(-1)
    assert torch.allclose(token_entropy(logits.detach(), 3, temperature, chunk_rows=2), entropy, atol=1e-12)


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_the_entropys_gradient_is_autograds_through_minus_sum_p_log_p(temperature):
    # the entropy bonus differentiates H: our by-block backward against autograd's of the formula
    torch.manual_seed(5)
    logits = torch.randn(2, 4, 11, dtype=F64, requires_grad=True)
    weights = torch.randn(2, 3, dtype=F64)
    (token_entropy(logits, 3, temperature, chunk_rows=2) * weights).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    log_p = torch.log_softmax(logits[:, :3] / temperature, dim=-1)
    (-(log_p.exp() * log_p).sum(-1) * weights).sum().backward()
    assert torch.allclose(ours, logits.grad, atol=1e-12)
    assert torch.equal(ours[:, 3], torch.zeros(2, 11, dtype=F64))  # past `length`: no gradient
    assert torch.autograd.gradcheck(
        lambda x: token_entropy(x, 3, temperature, chunk_rows=3), (logits.detach().requires_grad_(),)
    )


def test_the_uniform_distribution_has_the_largest_entropy_and_no_gradient():
    logits = torch.zeros(1, 1, 5, dtype=F64, requires_grad=True)
    token_entropy(logits).sum().backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))
