"""Periodic eval: greedy completions of held-out prompts scored by the run's rewards, and
optionally pass@k from sampled groups. Called by pipeline.run before the first step, every
`trainer.eval_every` steps and after the last.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from grpo_cli.config import EVAL_BATCH
from grpo_cli.distributed import sum_over_ranks
from grpo_cli.multiturn.rollout import MultiTurnSampler, final_answer

if TYPE_CHECKING:
    from grpo_cli.data.prompts import PromptSource
    from grpo_cli.rewards.api import RewardScorer
    from grpo_cli.sampling import Sampler


def evaluate(
    policy: torch.nn.Module,
    sampler: Sampler,
    scorer: RewardScorer,
    prompts: PromptSource,
    rows: list[dict[str, Any]],
    seed: int,
    pass_at_k: bool,
) -> dict[str, float]:
    """Greedy completions for the eval prompts, scored by the configured rewards.

    `eval/accuracy` is the mean score of the first reward function (by convention the task's
    correctness reward); `eval/<name>` the mean of each, `eval/reward` of the weighted total.
    With `pass_at_k` (trainer.eval_pass_at_k), also `eval/pass_at_k`: G = sampler.group_size sampled
    completions per prompt, the best first-function score among them, averaged over prompts
    (for a 0/1 correctness reward: the fraction of prompts solved at least once, pass@G).
    In a multi-turn run (rollout.tools / rollout.environment) the last turn is scored, and
    `eval/tool_use` is the fraction of eval prompts whose conversation called a tool,
    `eval/turns` their mean number of assistant turns.
    """
    world, names = prompts.world, scorer.names
    # Sums over this rank's prompts (every world_size-th one under torchrun), then over ranks.
    sums = {f"eval/{name}": 0.0 for name in names} | {"eval/reward": 0.0, "eval/pass_at_k": 0.0}
    multi_turn = isinstance(sampler, MultiTurnSampler)
    if multi_turn:
        sums |= {"eval/tool_use": 0.0, "eval/turns": 0.0}
    torch.manual_seed(seed + world.rank)  # the same pass@k draw at every eval (and on resume)
    mine = rows[world.rank :: world.world_size]
    # Every rank runs the same number of batches (FSDP ranks gather weights together): a short
    # share is topped up with copies of its first row, which weigh 0.
    share = -(-len(rows) // world.world_size)
    weights = torch.tensor([1.0] * len(mine) + [0.0] * (share - len(mine)))
    mine = mine + [rows[0]] * (share - len(mine))
    for start in range(0, share, EVAL_BATCH):
        chunk, weight = mine[start : start + EVAL_BATCH], weights[start : start + EVAL_BATCH]
        batch = prompts.make_batch(chunk)
        if multi_turn:
            played = sampler.greedy_conversations(policy, batch)
            completions = [final_answer(conversation) for conversation in played]
            weighted = list(zip(played, weight.tolist()))
            sums["eval/tool_use"] += sum(w for c, w in weighted if c.tool_calls)
            sums["eval/turns"] += sum(c.turns * w for c, w in weighted)
        else:
            completions = sampler.greedy(policy, batch)
        scored = scorer.score_texts(batch.texts, completions, batch.columns, (len(chunk),))
        sums["eval/reward"] += (scored.total * weight).sum().item()
        for name, values in scored.per_function.items():  # None (no opinion) counts 0
            sums[f"eval/{name}"] += (torch.nan_to_num(values, nan=0.0) * weight).sum().item()
        if pass_at_k:
            sums["eval/pass_at_k"] += _solved_sum(policy, sampler, scorer, prompts, chunk, weight)
    keys = sorted(sums)
    totals = dict(zip(keys, sum_over_ranks([sums[key] for key in keys], world)))
    metrics = {key: total / len(rows) for key, total in totals.items()}
    metrics["eval/accuracy"] = metrics[f"eval/{names[0]}"]
    if not pass_at_k:
        del metrics["eval/pass_at_k"]
    return metrics


def _solved_sum(
    policy: torch.nn.Module,
    sampler: Sampler,
    scorer: RewardScorer,
    prompts: PromptSource,
    rows: list[dict[str, Any]],
    weight: torch.Tensor,
) -> float:
    """Sum over `rows` of the best first-function score among G sampled completions, weighted.
    Sampled a training step's prompts at a time: a generate call never holds more sequences
    than the step's own sampling, which the memory plan counts."""
    step_prompts = prompts.prompts_per_rank
    first_function, total = scorer.names[0], 0.0
    for start in range(0, len(rows), step_prompts):
        batch = prompts.make_batch(rows[start : start + step_prompts])
        sampled = scorer.score(sampler.sample(policy, batch))
        first = torch.nan_to_num(sampled.per_function[first_function], nan=0.0)  # [b, G]
        total += (first.max(dim=1).values * weight[start : start + step_prompts]).sum().item()
    return total
