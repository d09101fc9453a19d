"""The metrics of one step, from its typed records: the keys of metrics.jsonl that are computed
(docs/GUIDE.md, "The run directory", lists them all with the timed ones)."""

from __future__ import annotations

from collections import Counter

from grpo_cli.records import Advantages, Rewards, Rollout, UpdateStats


def step_metrics(
    rollout: Rollout, rewards: Rewards, advantages: Advantages, stats: UpdateStats, beta: float, lr: float
) -> dict[str, float]:
    """The computed keys of the step's metrics.jsonl row (the loop adds the timed ones): rewards
    per function (None scores left out), advantages, the update's loss, KL, clipping, entropy
    and gradient norm, completion lengths, and the learning rate and beta in force."""
    lengths = rollout.trained_mask.sum(dim=1).float()  # the policy's own tokens (multi-turn: not the tools')
    metrics = {
        "reward/mean": rewards.total.mean().item(),
        "reward/std": rewards.total.std().item(),
    }
    for name, values in rewards.per_function.items():
        present = values[~values.isnan()]  # None ("no opinion" or lost) is left out of mean and std
        metrics[f"reward/{name}/mean"] = present.mean().item() if present.numel() else None
        metrics[f"reward/{name}/std"] = present.std().item() if present.numel() > 1 else None
        metrics[f"reward/{name}/errors"] = rewards.error_counts.get(name, 0)
    metrics.update(
        {
            "advantage/std": advantages.values.std().item(),
            "advantage/zero_std_fraction": advantages.zero_std_groups.float().mean().item(),
            "loss": stats.loss,
            "kl": stats.kl,
            "clip/fraction": stats.clip_fraction,
            "clip/high_fraction": stats.clip_high_fraction,
            "clip/low_fraction": stats.clip_low_fraction,
            "ratio/max_deviation": max(stats.ratio_deviation_by_pass, default=None),
            "entropy": stats.entropy,
            "grad_norm": stats.grad_norm,
            "skipped_updates": stats.skipped_steps,
            "completion/length_mean": lengths.mean().item(),
            "completion/length_max": int(lengths.max().item()),
            "completion/truncated_fraction": rollout.truncated.float().mean().item(),
            "lr": lr,
            "beta": beta,
        }
    )
    if "turns" in rollout.columns:  # multi-turn rollouts (multiturn/rollout.py)
        metrics.update(rollout_metrics(rollout))
    if stats.logprob_mismatch is not None:  # a sampler that returns log-probs (sampler=vllm)
        metrics["sampler/logprob_mismatch"] = stats.logprob_mismatch
        metrics["sampler/logprob_mismatch_max"] = stats.logprob_mismatch_max
        metrics["rollout_correction/capped_fraction"] = stats.corrected_fraction
    if stats.entropy_kept_fraction is not None:  # trainer.top_entropy_quantile < 1
        metrics["entropy/kept_fraction"] = stats.entropy_kept_fraction
    if len(stats.clip_fraction_by_pass) > 1:  # mu > 1: pass 1 never clips, the later ones show the drift
        for index, fraction in enumerate(stats.clip_fraction_by_pass, start=1):
            metrics[f"clip/fraction_pass{index}"] = fraction
    return metrics


def rollout_metrics(rollout: Rollout) -> dict[str, float]:
    """Per conversation, averaged: assistant turns, tool calls, the policy's tokens and the others'
    (the tools', the environment's, the template's); bad calls summed, by kind."""
    count = max(1, len(rollout.prompts))
    others = (rollout.completion_mask - rollout.trained_mask).sum(dim=1).float()
    metrics = {
        "rollout/turns": sum(rollout.columns["turns"]) / count,
        "rollout/tool_calls": sum(rollout.columns["tool_calls"]) / count,
        "rollout/tokens_policy": rollout.trained_mask.sum(dim=1).float().mean().item(),
        "rollout/tokens_other": others.mean().item(),
    }
    errors = sum((Counter(kinds) for kinds in rollout.columns["tool_errors"]), Counter())
    metrics["rollout/tool_errors"] = sum(errors.values())
    metrics.update({f"rollout/tool_errors/{kind}": number for kind, number in sorted(errors.items())})
    return metrics
