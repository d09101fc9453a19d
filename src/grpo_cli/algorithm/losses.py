"""Stage 5's math: per-token log-probs, KL estimators, the clipped surrogate and its aggregation.
Pure functions on tensors; docs/ALGORITHM.md gives every formula beside the key that selects it.

The objective of the GRPO paper (DeepSeekMath, eq. 3), maximized:

    J = 1/G sum_i 1/|o_i| sum_t [ min(rho_it A_i, clip(rho_it, 1 - eps, 1 + eps) A_i)
                                  - beta * KL_it ]
    rho_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t)
    KL_it  = pi_ref / pi_theta - log(pi_ref / pi_theta) - 1        (the k3 estimator, >= 0)

The code minimizes loss = -J. With the defaults (loss_aggregation=sequence_mean, kl_estimator=k3,
clip_eps_high = clip_eps) it is exactly the formula above, averaged over all B*G sequences of the
step (each prompt's group weighs the same, as every group has G completions). The variants:
- `clip_eps_high` (DAPO "clip-higher"): the upper bound becomes 1 + clip_eps_high.
- `kl_estimator`: k1 = log(pi/ref), k2 = (log(pi/ref))^2 / 2, k3 as above.
- `aggregation`: sequence_mean (the paper), token_mean (DAPO: every token of the step weighs the
  same), constant (Dr. GRPO: each sequence's token sum divided by max_new_tokens).
- `loss` (cispo, sapo), `importance_sampling_level` (GSPO), `delta`, `dual_clip`: the policy
  term min(rho A, clip(rho) A) replaced or bounded, one function each in objectives.py.
- `entropy_coef` (an entropy bonus) and `top_entropy_quantile` (the policy term on the
  highest-entropy tokens only): grpo_loss's `entropy`.
Departures from the paper, none of which change the formula:
- With num_iterations = 1 the "old" policy is the current one: rho = exp(logp - logp.detach()),
  which is 1 in value but still carries the gradient, exactly as the paper's single-pass case.
- KL is computed per token inside the loss (not as a penalty on the reward).
- pi is the distribution that sampled, softmax(logits / sampler.temperature), for the policy,
  pi_old and the reference alike (as TRL and verl do), so the tokens are samples of the pi
  in the formula and the ratio and the KL compare like with like.
- Positions outside the loss mask compare the policy with itself (ratio 1, KL 0).
Optional, off by default: `kl_importance_correction` multiplies each token's KL by rho_it
(DeepSeek-V3.2; TRL's use_bias_correction_kl, on by default there), which the paper's formula
does not have. The logged `kl` stays the plain estimate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from grpo_cli.algorithm.objectives import policy_objective
from grpo_cli.config import AGGREGATIONS, KL_ESTIMATORS, ROLLOUT_CORRECTIONS

LOGIT_CHUNK_ELEMENTS = 1 << 24  # float32 elements per chunk of logits (64 MiB): rows = this / vocab


def _blocks(logits: torch.Tensor, length: int, chunk_rows: int | None):
    """(sequences, positions) index pairs covering [N, length] in blocks of about chunk_rows
    positions: whole sequences at a time when they fit, else pieces of one sequence."""
    count, vocab = logits.shape[0], logits.shape[-1]
    rows = chunk_rows or max(1, LOGIT_CHUNK_ELEMENTS // vocab)
    sequences = max(1, rows // max(length, 1))
    positions = length if sequences > 1 else min(length, rows)
    for first in range(0, count, sequences):
        for start in range(0, length, positions):
            yield slice(first, first + sequences), slice(start, min(start + positions, length))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16/fp16 logits (their logsumexp is too coarse), float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


class _TokenLogProbs(torch.autograd.Function):
    """log softmax(logits / temperature)[token], block by block.

    The upcast copy of the logits and the softmax exist for one block of about `chunk_rows`
    positions at a time, in the forward and again in the backward, instead of a [N, T, V]
    float32 tensor kept for autograd; the logits themselves are read in place (no reshape copy,
    no slice), so the extra memory grows with batch x length, not with the vocabulary (152k for
    Qwen2.5). With x = logits / temperature:
    d/dlogits (x[token] - logsumexp(x)) = (onehot(token) - softmax(x)) / temperature.
    """

    @staticmethod
    def forward(ctx, logits, tokens, temperature, chunk_rows):  # [N, L, V], [N, T] with T <= L
        dtype = compute_dtype(logits.dtype)
        out = torch.empty(tokens.shape, dtype=dtype, device=logits.device)
        for seqs, pos in _blocks(logits, tokens.shape[1], chunk_rows):
            block = logits[seqs, pos].to(dtype) / temperature
            picked = block.gather(-1, tokens[seqs, pos].unsqueeze(-1)).squeeze(-1)
            out[seqs, pos] = picked - torch.logsumexp(block, dim=-1)
        ctx.save_for_backward(logits, tokens)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, tokens = ctx.saved_tensors
        grad = torch.zeros_like(logits)  # positions past T (the logit after the last token) get 0
        for seqs, pos in _blocks(logits, tokens.shape[1], ctx.chunk_rows):
            weight = grad_out[seqs, pos].unsqueeze(-1) / ctx.temperature  # [n, t, 1]
            block = torch.softmax(logits[seqs, pos].to(grad_out.dtype) / ctx.temperature, dim=-1)
            block.mul_(-weight).scatter_add_(-1, tokens[seqs, pos].unsqueeze(-1), weight)
            grad[seqs, pos] = block.to(grad.dtype)
        return grad, None, None, None


def token_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, chunk_rows: int | None = None
) -> torch.Tensor:
    """log pi(token) at each position, pi = softmax(logits / temperature).

    logits: [N, L, V] with L >= T, position t predicting tokens[:, t] ([N, T]); positions past
    T are ignored (so the caller need not slice off the model's last logit, which would copy).
    Returns [N, T] in float32 (float64 for float64 logits); see _TokenLogProbs for the memory.
    """
    return _TokenLogProbs.apply(logits, tokens, temperature, chunk_rows)


def entropy_gradient(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """d H / d logits of H = entropy(softmax(x)), x = logits / temperature, by row: [..., V].

    H = logsumexp(x) - sum_k p_k x_k, so dH/dx_j = p_j - (p_j + p_j x_j - p_j E_p[x])
    = -p_j (x_j - E_p[x]), divided by the temperature for the logits. Example: x = (0, 0) is
    the maximum (H = log 2): gradient (0, 0)."""
    x = logits / temperature
    p = torch.softmax(x, dim=-1)
    return p.mul_(x - (p * x).sum(dim=-1, keepdim=True)).neg_().div_(temperature)


class _TokenEntropy(torch.autograd.Function):
    """Entropy of softmax(logits / temperature) at the first `length` positions, block by
    block (as _TokenLogProbs: no [N, T, V] float32 copy kept for autograd); its gradient
    (entropy_gradient) serves the entropy bonus (trainer.entropy_coef)."""

    @staticmethod
    def forward(ctx, logits, length, temperature, chunk_rows):  # [N, L, V] -> [N, length]
        out = torch.empty(logits.shape[0], length, dtype=compute_dtype(logits.dtype), device=logits.device)
        for seqs, pos in _blocks(logits, length, chunk_rows):
            block = logits[seqs, pos].to(out.dtype) / temperature
            out[seqs, pos] = torch.logsumexp(block, dim=-1) - (torch.softmax(block, dim=-1) * block).sum(dim=-1)
        ctx.save_for_backward(logits)
        ctx.length, ctx.temperature, ctx.chunk_rows = length, temperature, chunk_rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (logits,) = ctx.saved_tensors
        grad = torch.zeros_like(logits)  # positions past `length` get 0
        for seqs, pos in _blocks(logits, ctx.length, ctx.chunk_rows):
            block = entropy_gradient(logits[seqs, pos].to(grad_out.dtype), ctx.temperature)
            grad[seqs, pos] = (block * grad_out[seqs, pos].unsqueeze(-1)).to(grad.dtype)
        return grad, None, None, None


def token_entropy(
    logits: torch.Tensor, length: int | None = None, temperature: float = 1.0, chunk_rows: int | None = None
) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) at the first `length` positions (all if None):
    [N, L, V] -> [N, length], H = logsumexp(x) - sum softmax(x) * x, by blocks; differentiable
    (the entropy bonus), free of autograd under no_grad.
    """
    length = logits.shape[1] if length is None else length
    return _TokenEntropy.apply(logits, length, temperature, chunk_rows)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """The loss tokens among the top `quantile` of `mask`'s tokens by entropy ("Beyond the
    80/20 rule", Wang et al. 2025; TRL's top_entropy_quantile): entropy >= the (1 - quantile)
    quantile of the masked entropies (torch.quantile, linear interpolation, as TRL). [N, T] ->
    [N, T] bool. quantile 1 keeps every token; 0 the highest only (and its ties).
    Example: entropies [0.1, 0.5, 0.9, 2.0], quantile 0.5 -> threshold 0.7: [F, F, T, T]."""
    tokens = mask.bool()
    if quantile >= 1.0 or not tokens.any():
        return tokens
    threshold = torch.quantile(entropy.detach()[tokens].float(), 1.0 - quantile)
    return (entropy.detach() >= threshold) & tokens


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from the sampled token's log-probs. [N, T] -> [N, T].

    With d = ref - logp (= log(ref / pi)):
      k1 = -d              unbiased in value, can be negative, its gradient is 0 in expectation
      k2 = d^2 / 2         >= 0; its gradient is the true gradient of KL(pi || ref)
      k3 = e^d - d - 1     >= 0, unbiased in value (the paper's choice)
    Example: logp = log 0.5, ref = log 0.25 -> d = -log 2 = -0.693147:
      k1 = 0.693147, k2 = 0.240227, k3 = 0.5 + 0.693147 - 1 = 0.193147.
    """
    delta = ref_log_probs - log_probs
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta.square()
    if estimator == "k3":
        return torch.exp(delta) - delta - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; one of {', '.join(KL_ESTIMATORS)}")


def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return kl_estimate(log_probs, ref_log_probs, "k3")


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of each row over its masked positions: [N, T], [N, T] -> [N]. Empty rows give 0."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


class LossDenominators(NamedTuple):
    """The whole step's counts that each micro-batch's loss is divided by, so that the micro-batch
    losses add up to the step's loss whatever the micro-batch size."""

    sequences: int  # B*G completions in the step
    tokens: int  # completion tokens in the loss over the whole step (token_mean)
    max_new_tokens: int  # the constant of Dr. GRPO's aggregation


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str, step: LossDenominators) -> torch.Tensor:
    """Reduce per-token losses [N, T] of one micro-batch to its share of the step's scalar loss.

    sequence_mean: sum_i (1/|o_i| sum_t l_it) / sequences      (GRPO paper)
    token_mean:    sum_i sum_t l_it / tokens                    (DAPO)
    constant:      sum_i sum_t l_it / (sequences * max_new_tokens)   (Dr. GRPO)
    """
    if aggregation == "sequence_mean":
        return sequence_mean(per_token, mask).sum() / step.sequences
    masked_sum = (per_token * mask.to(per_token.dtype)).sum()
    if aggregation == "token_mean":
        return masked_sum / max(step.tokens, 1)
    if aggregation == "constant":
        return masked_sum / (step.sequences * step.max_new_tokens)
    raise ValueError(f"unknown loss aggregation {aggregation!r}; one of {', '.join(AGGREGATIONS)}")


class RolloutCorrection(NamedTuple):
    weights: torch.Tensor  # [N, T] w multiplying each token's policy term (no grad)
    capped: torch.Tensor  # [N, T] bool: loss tokens whose raw ratio exceeded the cap (truncated or masked)


def rollout_weights(
    trainer_log_probs: torch.Tensor,  # [N, T] log pi_old(token), the trainer's, at the weights that sampled
    sampler_log_probs: torch.Tensor,  # [N, T] log pi_sampler(token), what the sampler drew from
    mask: torch.Tensor,  # [N, T] tokens in the loss
    mode: str,
    cap: float,
) -> RolloutCorrection:
    """Truncated importance sampling for a sampler whose distribution is not the trainer's
    (TIS: Yao et al. 2025; TRL's vllm_importance_sampling_mode, verl's rollout_is, OpenRLHF's
    vllm_is_correction). With d_t = log pi_old(o_t) - log pi_sampler(o_t) over the loss tokens
    and C = cap:
        token_truncate:     w_t = min(e^{d_t}, C)
        token_mask:         w_t = e^{d_t} if e^{d_t} <= C, else 0
        sequence_truncate:  w_t = min(e^{D}, C)               D = sum_t d_t over the sequence
        sequence_mask:      w_t = e^{D} if e^{D} <= C, else 0
        none:               w_t = 1
    Positions outside the mask get d_t = 0. Example, one sequence, C = 2, d = [log 3, log 0.5]:
    token_truncate [2, 0.5]; token_mask [0, 0.5]; D = log 1.5: sequence_* [1.5, 1.5].
    """
    mask = mask.to(trainer_log_probs.dtype)
    log_ratio = (trainer_log_probs - sampler_log_probs.to(trainer_log_probs.dtype)) * mask
    if mode == "none":
        return RolloutCorrection(torch.ones_like(log_ratio), torch.zeros_like(log_ratio, dtype=torch.bool))
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout correction {mode!r}; one of {', '.join(ROLLOUT_CORRECTIONS)}")
    if mode.startswith("sequence_"):
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(log_ratio)
    ratio = torch.exp(log_ratio)  # may be inf for a sequence far off: truncated to C, or masked
    capped = (ratio > cap) & mask.bool()
    weights = ratio.clamp(max=cap) if mode.endswith("_truncate") else ratio.masked_fill(ratio > cap, 0.0)
    return RolloutCorrection(weights.detach(), capped)


def log_prob_mismatch(
    trainer_log_probs: torch.Tensor, sampler_log_probs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """|log pi_trainer - log pi_sampler| over the masked tokens: (its sum, its max), scalars."""
    gap = (trainer_log_probs.detach() - sampler_log_probs.to(trainer_log_probs.dtype)).abs() * mask
    return gap.sum(), gap.max() if gap.numel() else torch.zeros(())


@dataclass(frozen=True)
class LossSettings:
    clip_eps: float  # lower clip: rho >= 1 - clip_eps
    clip_eps_high: float  # upper clip: rho <= 1 + clip_eps_high (= clip_eps in the paper)
    beta: float  # KL coefficient in force this step
    kl_estimator: str = "k3"
    aggregation: str = "sequence_mean"
    kl_importance_correction: bool = False  # KL_it x rho_it (DeepSeek-V3.2; TRL's use_bias_correction_kl)
    # The policy term (objectives.py; each the trainer key of the same name):
    loss: str = "clip"  # clip (the paper) | cispo | sapo
    importance_sampling_level: str = "token"  # token | sequence (GSPO)
    delta: float | None = None  # clip: the unclipped ratio capped at delta (INTELLECT-2)
    dual_clip: float | None = None  # clip: for A < 0 the objective is at least dual_clip * A
    cispo_ratio_min: float | None = None  # cispo: the weight's lower bound (None: none, as MiniMax-M1)
    cispo_ratio_max: float = 5.0  # cispo: the weight's upper bound (ScaleRL's eps_max)
    sapo_temperature_pos: float = 1.0  # sapo: tau for A > 0
    sapo_temperature_neg: float = 1.05  # sapo: tau for A <= 0
    # Entropy controls (each needs the entropy passed to grpo_loss):
    entropy_coef: float = 0.0  # the bonus: loss - entropy_coef * aggregate(H), H with its gradient
    top_entropy_quantile: float = 1.0  # the policy term on the top-q tokens by entropy only (1: all)

    @property
    def uses_entropy(self) -> bool:
        return self.entropy_coef != 0.0 or self.top_entropy_quantile < 1.0


def grpo_loss(
    log_probs: torch.Tensor,  # [N, T] current policy, with grad
    old_log_probs: torch.Tensor,  # [N, T] the policy that sampled (no grad)
    ref_log_probs: torch.Tensor | None,  # [N, T] frozen reference, None when there is none
    advantages: torch.Tensor,  # [N]
    mask: torch.Tensor,  # [N, T] completion tokens in the loss
    settings: LossSettings,
    step: LossDenominators,
    rollout_weights: torch.Tensor | None = None,  # [N, T] (no grad): the rollout correction's w
    entropy: torch.Tensor | None = None,  # [N, T] the policy's entropy, with grad (settings.uses_entropy)
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one micro-batch, and detached sums for the step's metrics. `rollout_weights`
    multiply each token's policy term (not its KL term), as TRL, verl and OpenRLHF apply them.
    The entropy controls: top_entropy_quantile < 1 keeps the policy term (not the KL) of this
    micro-batch's high_entropy_mask tokens only, as TRL does; entropy_coef adds -coef * H on the
    same tokens, aggregated as the loss (verl's entropy_coeff), so the micro-batches still add up.

    Worked example, one token, A = 1, eps = 0.2: logp - old = log 1.5 -> rho = 1.5, clipped to
    1.2; min(1.5 * 1, 1.2 * 1) = 1.2, so the token contributes -1.2 and no gradient (the clipped
    branch is constant). With A = -1 the min picks 1.5 * -1 = -1.5: loss +1.5, gradient flows.
    """
    tokens = mask.bool()
    # Positions outside the mask (padding after EOS) compare the policy with itself: their
    # ratio is 1 and their KL 0, so an extreme log-prob there cannot turn the sum into inf * 0.
    detached = log_probs.detach()
    old_log_probs = torch.where(tokens, old_log_probs, detached)
    advantages = advantages.unsqueeze(1)  # [N, 1], shared by all tokens of a completion
    policy = policy_objective(log_probs, old_log_probs, advantages, mask, settings)
    ratio = policy.ratio  # [N, T], or [N, 1] at the sequence level
    per_token = -policy.objective.expand_as(log_probs)  # [N, T]
    if rollout_weights is not None:
        per_token = per_token * rollout_weights
    kept = tokens
    if settings.uses_entropy:
        if entropy is None:
            raise ValueError("entropy_coef and top_entropy_quantile need the policy's entropy")
        kept = high_entropy_mask(entropy, mask, settings.top_entropy_quantile)  # [N, T] bool
        if settings.top_entropy_quantile < 1.0:
            per_token = per_token * kept
        if settings.entropy_coef != 0.0:
            per_token = per_token - settings.entropy_coef * entropy * kept
    kl = None
    if ref_log_probs is not None:
        kl = kl_estimate(log_probs, torch.where(tokens, ref_log_probs, detached), settings.kl_estimator)
        if settings.beta > 0:
            # The correction weighs each token's KL by rho: the tokens were drawn from pi_old,
            # so this makes the estimate unbiased for pi_theta's KL when the two differ.
            penalty = kl * ratio if settings.kl_importance_correction else kl
            per_token = per_token + settings.beta * penalty
    loss = aggregate(per_token, mask, settings.aggregation, step)

    with torch.no_grad():
        was_clipped = policy.clipped.expand_as(tokens) & tokens  # the gradient stopped by a clip
        metrics = {
            "tokens": tokens.sum(),
            "entropy_kept": kept.sum(),  # loss tokens the entropy mask keeps (all without one)
            "clipped_high": (was_clipped & (advantages > 0)).sum(),  # rho > 1 + clip_eps_high
            "clipped_low": (was_clipped & (advantages < 0)).sum(),  # rho < 1 - clip_eps
            "kl_sum": (kl * mask).sum() if kl is not None else torch.zeros(()),
            "ratio_max_deviation": ((ratio - 1).abs() * mask).max() if tokens.any() else torch.zeros(()),
        }
    return loss, metrics
