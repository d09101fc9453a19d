"""trainer.rollout_correction (algorithm/losses.rollout_weights): the truncated importance
sampling that corrects for a sampler whose log-probs differ from the trainer's, against a
literal transcription of each mode written with loops (docs/ALGORITHM.md gives the formulas),
and through the update, where the sampler's log-probs arrive in Rollout.sampler_log_probs.

    d_t = log pi_old(o_t) - log pi_sampler(o_t)            (the trainer's at the weights that sampled)
    token_truncate     w_t = min(e^{d_t}, C)           token_mask     w_t = e^{d_t} [e^{d_t} <= C]
    sequence_truncate  w_t = min(e^{sum_s d_s}, C)     sequence_mask  w_t = e^{sum_s d_s} [... <= C]
    -J = -sum_i w_i sum_t m_it [ w_t min(rho A, clip(rho) A) - beta KL_it ]

The expected values are never computed with the function under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_cli.algorithm.losses import (
    LossDenominators,
    LossSettings,
    grpo_loss,
    log_prob_mismatch,
    rollout_weights,
)
from test_objective import F64, paper_clip, paper_kl, random_step

CAP = 2.0
MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def paper_weights(trainer_log_probs, sampler_log_probs, mask, mode: str, cap: float) -> list[list[float]]:
    """w_it by explicit loops, each mode as written above (positions outside the mask: d = 0)."""
    rows, length = trainer_log_probs.shape
    weights = []
    for i in range(rows):
        d = [float(trainer_log_probs[i, t] - sampler_log_probs[i, t]) if mask[i, t] else 0.0 for t in range(length)]
        if mode == "none":
            weights.append([1.0] * length)
            continue
        if mode.startswith("sequence"):
            total = sum(d)
            ratios = [math.exp(total)] * length
        else:
            ratios = [math.exp(value) for value in d]
        if mode.endswith("truncate"):
            weights.append([min(ratio, cap) for ratio in ratios])
        else:
            weights.append([ratio if ratio <= cap else 0.0 for ratio in ratios])
    return weights


def sampler_step(seed: int = 0):
    """random_step's tensors, and a sampler's log-probs off the old policy's by noise of std 0.5
    (a ratio e^d outside [1/2, 2] for about a sixth of the tokens) plus one sequence far off."""
    rewards, log_probs, old, ref, mask = random_step(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    sampler = old + 0.5 * torch.randn(old.shape, generator=generator, dtype=F64)
    sampler[1] = old[1] - 3.0  # every token 20x more likely to the trainer: the sequence ratio overflows the cap
    return rewards, log_probs, old, ref, mask, sampler


@pytest.mark.parametrize("mode", [*MODES, "none"])
def test_the_weights_are_the_literal_formulas(mode):
    _, _, old, _, mask, sampler = sampler_step()
    correction = rollout_weights(old, sampler, mask, mode, CAP)
    expected = torch.tensor(paper_weights(old, sampler, mask, mode, CAP), dtype=F64)
    assert torch.allclose(correction.weights, expected, rtol=1e-12, atol=0)
    if mode != "none":  # the data exercise the cap, and which tokens passed it is counted
        ratio = torch.exp((old - sampler) * mask)
        if mode.startswith("sequence"):
            ratio = torch.exp(((old - sampler) * mask).sum(dim=1, keepdim=True)).expand_as(ratio)
        assert torch.equal(correction.capped, (ratio > CAP) & mask.bool())
        assert 0 < int(correction.capped.sum()) < int(mask.sum())


def test_the_worked_example_of_the_docstring():
    old = torch.tensor([[math.log(3.0), math.log(0.5)]], dtype=F64)
    sampler = torch.zeros_like(old)
    mask = torch.ones_like(old, dtype=torch.long)
    by_mode = {mode: rollout_weights(old, sampler, mask, mode, 2.0).weights[0].tolist() for mode in MODES}
    assert by_mode["token_truncate"] == pytest.approx([2.0, 0.5])
    assert by_mode["token_mask"] == pytest.approx([0.0, 0.5])
    assert by_mode["sequence_truncate"] == pytest.approx([1.5, 1.5])
    assert by_mode["sequence_mask"] == pytest.approx([1.5, 1.5])


def test_an_unknown_mode_is_refused():
    tensor = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="unknown rollout correction 'token'"):
        rollout_weights(tensor, tensor, tensor, "token", 2.0)


def paper_corrected_objective(log_probs, old, ref, advantages, mask, weights):
    """-J of the GRPO paper (sequence_mean, k3, eps 0.2) with each token's surrogate weighed by w_it."""
    rows, length = log_probs.shape
    objective = torch.zeros((), dtype=F64)
    for i in range(rows):
        tokens = int(mask[i].sum())
        if tokens == 0:
            continue
        row = torch.zeros((), dtype=F64)
        for t in range(length):
            if mask[i, t]:
                rho = torch.exp(log_probs[i, t] - old[i, t])
                surrogate = min(rho * advantages[i], paper_clip(rho, 0.8, 1.2) * advantages[i])
                row = row + weights[i][t] * surrogate - 0.04 * paper_kl(log_probs[i, t], ref[i, t], "k3")
        objective = objective + row / tokens / rows
    return -objective


@pytest.mark.parametrize("mode", MODES)
def test_the_loss_weighs_the_policy_term_and_not_the_kl(mode):
    _, log_probs, old, ref, mask, sampler = sampler_step()
    advantages = torch.linspace(-1.5, 1.5, log_probs.shape[0], dtype=F64)
    settings = LossSettings(clip_eps=0.2, clip_eps_high=0.2, beta=0.04)
    step = LossDenominators(sequences=mask.shape[0], tokens=int(mask.sum()), max_new_tokens=9)
    ours_input = log_probs.clone().requires_grad_()
    weights = rollout_weights(old, sampler, mask, mode, CAP).weights
    ours, _ = grpo_loss(ours_input, old, ref, advantages, mask, settings, step, weights)
    ours.backward()
    paper_input = log_probs.clone().requires_grad_()
    paper = paper_corrected_objective(
        paper_input, old, ref, advantages, mask, paper_weights(old, sampler, mask, mode, CAP)
    )
    paper.backward()
    assert torch.allclose(ours, paper, atol=1e-10), (ours.item(), paper.item())
    assert torch.allclose(ours_input.grad, paper_input.grad, atol=1e-10)
    uncorrected, _ = grpo_loss(log_probs, old, ref, advantages, mask, settings, step)
    assert not torch.allclose(ours, uncorrected)  # the weights did something


def test_the_mismatch_is_the_mean_and_max_gap_over_the_masked_tokens():
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    sampler = torch.tensor([[-1.1, -1.5, -3.0], [-0.5, -0.7, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the 9.0 gap is padding
    total, largest = log_prob_mismatch(trainer, sampler, mask)
    assert total.item() == pytest.approx(0.1 + 0.5 + 0.0 + 0.0 + 0.2)
    assert largest.item() == pytest.approx(0.5)


# ---------------------------------------------------------------- through the update


def update_with_sampler_log_probs(tiny_model_dir, offsets, *overrides):
    """One update of the tiny model on a fast-sampler rollout whose sampler_log_probs are the
    trainer's own log-probs plus `offsets(mask)` ([N, T]) (None: no sampler log-probs at all).
    Returns (UpdateStats, the gradient-free weights after the step)."""
    from grpo_cli.algorithm.advantages import group_advantages
    from grpo_cli.algorithm.log_probs import completion_log_probs
    from grpo_cli.algorithm.optim import make_optimizer, make_scheduler
    from grpo_cli.algorithm.update import update_policy
    from grpo_cli.data.prompts import PromptSource
    from grpo_cli.models.loading import load_models, trainable_parameters
    from grpo_cli.sampling import make_sampler
    from helpers import config

    cfg = config(tiny_model_dir, "trainer.beta=0.0", *overrides)
    torch.manual_seed(0)
    models = load_models(cfg.model, 0.0, torch.device("cpu"))
    batch = PromptSource(cfg.data, models.tokenizer).next_batch()
    rollout = make_sampler(cfg.sampler, models.tokenizer).sample(models.policy, batch)
    if offsets is not None:
        with torch.no_grad():
            own, _ = completion_log_probs(
                models.policy, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask
            )
        rollout.sampler_log_probs = own + offsets(rollout.completion_mask)
    advantages = group_advantages(torch.tensor([[1.0, 0.0, 1.0, 0.0]] * batch.size), 1e-4, 1e-4)
    parameters = trainable_parameters(models.policy)
    optimizer = make_optimizer(cfg.optimizer, parameters)
    scheduler = make_scheduler(cfg.optimizer, optimizer, 1)
    stats = update_policy(models, rollout, advantages, optimizer, scheduler, cfg.trainer, 1.0, 0.0)
    return stats, [p.detach().clone() for p in parameters]


def test_a_sampler_that_agrees_with_the_trainer_changes_nothing(tiny_model_dir):
    plain, _ = update_with_sampler_log_probs(tiny_model_dir, None)
    agreeing, _ = update_with_sampler_log_probs(tiny_model_dir, torch.zeros_like)
    assert plain.logprob_mismatch is None and plain.corrected_fraction is None
    assert agreeing.logprob_mismatch == pytest.approx(0.0, abs=1e-6) and agreeing.corrected_fraction == 0.0
    # The sampler's log-probs here came from a plain forward, the update's from the shared prompt
    # pass: equal up to float32 rounding (w = e^{+-1e-7}), so the gradient is, to that rounding.
    assert agreeing.grad_norm == pytest.approx(plain.grad_norm, rel=1e-5)


def test_the_update_measures_and_corrects_a_sampler_that_disagrees(tiny_model_dir):
    # The sampler gave every completion token 1.0 more log-prob than the trainer does: d = -1,
    # w = e^-1 on every token (under the cap), so the mismatch is 1.0, nothing is capped, and the
    # gradient is e^-1 of the uncorrected one; `none` trains as if there were no sampler log-probs.
    def higher(mask):
        return mask.float()

    corrected, corrected_weights = update_with_sampler_log_probs(tiny_model_dir, higher)
    assert corrected.logprob_mismatch == pytest.approx(1.0, abs=1e-5)
    assert corrected.logprob_mismatch_max == pytest.approx(1.0, abs=1e-5)
    assert corrected.corrected_fraction == 0.0
    uncorrected, uncorrected_weights = update_with_sampler_log_probs(
        tiny_model_dir, higher, "trainer.rollout_correction=none"
    )
    plain, plain_weights = update_with_sampler_log_probs(tiny_model_dir, None)
    assert uncorrected.logprob_mismatch == pytest.approx(1.0, abs=1e-5)  # measured whatever the mode
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(plain_weights, uncorrected_weights))
    assert corrected.grad_norm == pytest.approx(plain.grad_norm * math.exp(-1.0), rel=1e-4)
    assert not all(torch.allclose(a, b, atol=1e-7) for a, b in zip(plain_weights, corrected_weights))

    # 3.0 less: w = e^3 > 2 on every token, all capped; masked, nothing is left to train on.
    masked, _ = update_with_sampler_log_probs(
        tiny_model_dir, lambda mask: -3.0 * mask.float(), "trainer.rollout_correction=token_mask"
    )
    assert masked.corrected_fraction == 1.0 and masked.grad_norm == 0.0
