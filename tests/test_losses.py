import math

import pytest
import torch

from grpo_cli.algorithm.losses import (
    LossDenominators,
    LossSettings,
    grpo_loss,
    kl_k3,
    sequence_mean,
    token_entropy,
    token_log_probs,
)
from grpo_cli.sampling.rollouts import completion_mask


def paper(clip_eps: float = 0.2, beta: float = 0.0) -> LossSettings:
    """The paper's settings: symmetric clip, k3, per-sequence mean."""
    return LossSettings(clip_eps=clip_eps, clip_eps_high=clip_eps, beta=beta)


def size(sequences: int, tokens: int = 0, max_new_tokens: int = 0) -> LossDenominators:
    return LossDenominators(sequences, tokens, max_new_tokens)


def test_token_log_probs_match_log_softmax():
    logits = torch.randn(2, 3, 5)
    tokens = torch.tensor([[0, 4, 2], [1, 1, 3]])
    expected = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(token_log_probs(logits, tokens), expected, atol=1e-6)


def test_entropy_of_uniform_is_log_vocab():
    assert torch.allclose(token_entropy(torch.zeros(1, 2, 4)), torch.full((1, 2), math.log(4)))


def test_k3_by_hand():
    # logp = log 0.5, ref = log 0.25: d = ref - logp = -log 2; k3 = e^d - d - 1 = 0.5 + 0.693147 - 1
    value = kl_k3(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]))
    assert value.item() == pytest.approx(0.193147, abs=1e-6)
    assert kl_k3(torch.tensor([-1.3]), torch.tensor([-1.3])).item() == 0.0


def test_sequence_mean_ignores_masked_tokens_and_empty_rows():
    values = torch.tensor([[1.0, 3.0, 100.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert sequence_mean(values, mask).tolist() == [2.0, 0.0]


def _one_token(logp_minus_old: float, advantage: float, clip_eps: float = 0.2):
    log_probs = torch.tensor([[logp_minus_old]], requires_grad=True)
    loss, metrics = grpo_loss(
        log_probs,
        torch.zeros(1, 1),
        None,
        torch.tensor([advantage]),
        torch.ones(1, 1),
        paper(clip_eps),
        size(1),
    )
    loss.backward()
    clipped = metrics["clipped_high"].item() + metrics["clipped_low"].item()
    return loss.item(), log_probs.grad.item(), clipped


def test_ratio_above_the_clip_with_positive_advantage_is_clipped_and_has_no_gradient():
    # rho = 1.5 > 1.2, A = 1: min(1.5, 1.2) = 1.2 -> loss -1.2, clipped branch is constant.
    loss, grad, clipped = _one_token(math.log(1.5), 1.0)
    assert loss == pytest.approx(-1.2) and grad == 0.0 and clipped == 1


def test_ratio_above_the_clip_with_negative_advantage_keeps_the_gradient():
    # rho = 1.5, A = -1: min(-1.5, -1.2) = -1.5 -> loss 1.5; d loss / d logp = -A * rho = 1.5
    loss, grad, clipped = _one_token(math.log(1.5), -1.0)
    assert loss == pytest.approx(1.5) and grad == pytest.approx(1.5) and clipped == 0


def test_ratio_below_the_clip_with_negative_advantage_is_clipped():
    # rho = 0.5 < 0.8, A = -1: min(-0.5, -0.8) = -0.8 -> loss 0.8, no gradient.
    loss, grad, clipped = _one_token(math.log(0.5), -1.0)
    assert loss == pytest.approx(0.8) and grad == 0.0 and clipped == 1


def test_ratio_below_the_clip_with_positive_advantage_keeps_the_gradient():
    # rho = 0.5, A = 2: min(1.0, 1.6) = 1.0 -> loss -1.0; gradient -A * rho = -1.0
    loss, grad, clipped = _one_token(math.log(0.5), 2.0)
    assert loss == pytest.approx(-1.0) and grad == pytest.approx(-1.0) and clipped == 0


def test_on_policy_gradient_is_minus_advantage_over_length():
    # num_iterations = 1: old = logp.detach(), rho = 1 with d rho / d logp = 1, so each token's
    # gradient is -A / |o| / N. Two sequences (N = 2): lengths 2 and 1, A = (1, -2).
    log_probs = torch.zeros(2, 2, requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, _ = grpo_loss(log_probs, log_probs.detach(), None, torch.tensor([1.0, -2.0]), mask, paper(), size(2))
    loss.backward()
    # loss = -(1 * 1 + (-2) * 1) / 2 = 0.5
    assert loss.item() == pytest.approx(0.5)
    assert torch.allclose(log_probs.grad, torch.tensor([[-0.25, -0.25], [1.0, 0.0]]))


def test_kl_term_adds_beta_times_k3_averaged_per_sequence():
    # A = 0, so only the KL term: tokens with k3 = 0.193147 (ref = logp - log 2) and 0.
    # per-sequence mean (0.193147 + 0) / 2, times beta 0.1, over 1 sequence = 0.0096574
    log_probs = torch.log(torch.tensor([[0.5, 0.3]]))
    ref = torch.log(torch.tensor([[0.25, 0.3]]))
    loss, metrics = grpo_loss(log_probs, log_probs, ref, torch.zeros(1), torch.ones(1, 2), paper(beta=0.1), size(1))
    assert loss.item() == pytest.approx(0.1 * 0.193147 / 2, abs=1e-6)
    assert metrics["kl_sum"].item() == pytest.approx(0.193147, abs=1e-6)


def test_micro_batch_losses_add_up_to_the_full_batch_loss():
    torch.manual_seed(0)
    log_probs, old, ref = torch.randn(6, 4), torch.randn(6, 4), torch.randn(6, 4)
    advantages, mask = torch.randn(6), (torch.rand(6, 4) > 0.3).long()
    arguments = dict(settings=paper(beta=0.04), step=size(6))
    full, _ = grpo_loss(log_probs, old, ref, advantages, mask, **arguments)
    parts = sum(
        grpo_loss(log_probs[s], old[s], ref[s], advantages[s], mask[s], **arguments)[0]
        for s in (slice(0, 2), slice(2, 4), slice(4, 6))
    )
    assert torch.allclose(full, parts, atol=1e-6)


def test_completion_mask_counts_up_to_and_including_the_first_eos():
    ids = torch.tensor([[5, 9, 9, 9], [5, 6, 7, 8], [9, 4, 9, 1]])
    mask, truncated = completion_mask(ids, eos_token_id=9)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]


def test_extreme_log_probs_outside_the_mask_cannot_poison_the_loss():
    # Padding after EOS is outside the mask; there the reference says log-prob 0 and the policy
    # -200: e^(0 - -200) overflows to inf, and inf * 0 would be NaN. Masked positions compare
    # the policy with itself, so loss and gradient stay finite and equal the unpadded ones.
    log_probs = torch.tensor([[-1.0, -200.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.0]])
    ref = torch.tensor([[-0.9, 0.0]])
    mask = torch.tensor([[1, 0]])
    loss, metrics = grpo_loss(log_probs, old, ref, torch.tensor([1.0]), mask, paper(beta=0.1), size(1))
    loss.backward()
    short = torch.tensor([[-1.0]], requires_grad=True)
    expected, _ = grpo_loss(short, old[:, :1], ref[:, :1], torch.tensor([1.0]), mask[:, :1], paper(beta=0.1), size(1))
    expected.backward()
    assert torch.isfinite(loss) and loss.item() == pytest.approx(expected.item())
    assert log_probs.grad[0, 1] == 0.0 and log_probs.grad[0, 0] == pytest.approx(short.grad[0, 0].item())
    assert torch.isfinite(metrics["kl_sum"])
