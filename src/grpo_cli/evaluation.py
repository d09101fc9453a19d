"""Periodic eval: greedy completions of held-out prompts scored by the run's rewards, and
optionally pass@k from sampled groups. Called by pipeline.run before the first step, every
`trainer.eval_every` steps and after the last.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from grpo_cli.prompts import batches

if TYPE_CHECKING:
    from grpo_cli.pipeline import RunParts

EVAL_BATCH = 64  # eval prompts per greedy generate call


def evaluate(parts: RunParts, rows: list[dict[str, Any]]) -> dict[str, float]:
    """Greedy completions for the eval prompts, scored by the configured rewards.

    `eval/accuracy` is the mean score of the first reward function (by convention the task's
    correctness reward); `eval/<name>` the mean of each, `eval/reward` of the weighted total.
    With trainer.eval_pass_at_k, also `eval/pass_at_k`: G = sampler.group_size sampled
    completions per prompt, the best first-function score among them, averaged over prompts
    (for a 0/1 correctness reward: the fraction of prompts solved at least once, pass@G).
    """
    scorer, policy = parts.scorer, parts.models.policy
    per_function: dict[str, list[float]] = {name: [] for name in scorer.names}
    totals: list[float] = []
    best_of_group: list[float] = []
    torch.manual_seed(parts.cfg.trainer.seed)  # the same pass@k draw at every eval (and on resume)
    for chunk in batches(rows, EVAL_BATCH):
        batch = parts.prompts.make_batch(chunk)
        completions = parts.sampler.greedy(policy, batch)
        scored = scorer.score_texts(batch.texts, completions, batch.columns, (len(chunk),))
        totals += scored.total.tolist()
        for name, values in scored.per_function.items():
            per_function[name] += torch.nan_to_num(values, nan=0.0).tolist()
        if parts.cfg.trainer.eval_pass_at_k:
            sampled = scorer.score(parts.sampler.sample(policy, batch))
            first = torch.nan_to_num(sampled.per_function[scorer.names[0]], nan=0.0)  # [B, G]
            best_of_group += first.max(dim=1).values.tolist()
    metrics = {f"eval/{name}": sum(v) / len(v) for name, v in per_function.items()}
    metrics["eval/reward"] = sum(totals) / len(totals)
    metrics["eval/accuracy"] = metrics[f"eval/{scorer.names[0]}"]
    if best_of_group:
        metrics["eval/pass_at_k"] = sum(best_of_group) / len(best_of_group)
    return metrics
