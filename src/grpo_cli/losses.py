"""Stage 5's math: per-token log-probs, the k3 KL estimator and the GRPO loss. Pure functions.

The objective of the GRPO paper (DeepSeekMath, eq. 3), maximized:

    J = 1/G sum_i 1/|o_i| sum_t [ min(rho_it A_i, clip(rho_it, 1 - eps, 1 + eps) A_i)
                                  - beta * KL_it ]
    rho_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t)
    KL_it  = pi_ref / pi_theta - log(pi_ref / pi_theta) - 1        (the k3 estimator, >= 0)

The code minimizes loss = -J with the same three parts, and averages over all B*G sequences of
the step (each prompt's group weighs the same when all groups have G completions). Departures
from the paper, none of which change the formula above:
- With num_iterations = 1 the "old" policy is the current one: rho = exp(logp - logp.detach()),
  which is 1 in value but still carries the gradient, exactly as the paper's single-pass case.
- KL is the k3 estimator computed per token inside the loss (not a penalty on the reward).
- Log-probs are those of the policy itself (temperature 1), whatever temperature sampled them.
"""

from __future__ import annotations

import torch


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log pi(token) at each position. logits: [N, T, V] (predicting tokens [N, T]) -> [N, T].

    Computed as logit - logsumexp(logits) in float32, without materializing a [N, T, V]
    log-softmax: the vocabulary of real models is large.
    """
    logits = logits.float()
    picked = torch.gather(logits, dim=-1, index=tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at each position: [N, T, V] -> [N, T]."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): exp(d) - d - 1 with d = ref - logp. Never negative.

    Example: logp = log 0.5, ref = log 0.25 -> d = -log 2, k3 = 0.5 + 0.6931 - 1 = 0.1931.
    """
    delta = ref_log_probs - log_probs
    return torch.exp(delta) - delta - 1.0


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of each row over its masked positions: [N, T], [N, T] -> [N]. Empty rows give 0."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


def grpo_loss(
    log_probs: torch.Tensor,  # [N, T] current policy, with grad
    old_log_probs: torch.Tensor,  # [N, T] the policy that sampled (no grad)
    ref_log_probs: torch.Tensor | None,  # [N, T] frozen reference, None when beta = 0
    advantages: torch.Tensor,  # [N]
    mask: torch.Tensor,  # [N, T] completion tokens
    clip_eps: float,
    beta: float,
    num_sequences: int,  # sequences in the whole step, so micro-batch losses add up to the mean
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss of one micro-batch, and sums for the step's metrics (detached).

    Worked example, one token, A = 1, eps = 0.2: logp - old = log 1.5 -> rho = 1.5, clipped to
    1.2; min(1.5 * 1, 1.2 * 1) = 1.2, so the token contributes -1.2 and no gradient (the clipped
    branch is constant). With A = -1 the min picks 1.5 * -1 = -1.5: loss +1.5, gradient flows.
    """
    ratio = torch.exp(log_probs - old_log_probs)
    advantages = advantages.unsqueeze(1)  # [N, 1], shared by all tokens of a completion
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    surrogate = torch.minimum(unclipped, clipped)  # [N, T]
    per_token = -surrogate
    kl = None
    if ref_log_probs is not None and beta > 0:
        kl = kl_k3(log_probs, ref_log_probs)
        per_token = per_token + beta * kl
    loss = sequence_mean(per_token, mask).sum() / num_sequences

    tokens = mask.bool()
    was_clipped = (clipped < unclipped) & tokens  # the min took the clipped branch
    metrics = {
        "tokens": tokens.sum().detach(),
        "clipped_tokens": was_clipped.sum().detach(),
        "kl_sum": (kl.detach() * mask).sum() if kl is not None else torch.zeros(()),
    }
    return loss, metrics
