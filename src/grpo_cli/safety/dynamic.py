"""Stage 3b, dynamic sampling (DAPO, Yu et al. 2025): with trainer.filter_zero_std, a step trains
only on groups whose rewards differ.

A group whose G rewards are all equal (every completion right, or every one wrong) has zero
advantages: it adds no policy gradient, only dilutes the step. So such groups are dropped and
more prompts are sampled, one batch of prompts_per_step at a time, until the step has
prompts_per_step informative groups or `max_resample_rounds` extra rounds were spent. A step
still short after that is topped up with uninformative groups (A = 0, only the KL term acts on
them) so that every step trains on the same number of completions; the shortfall is logged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_cli.records import Rewards, Rollout


@dataclass
class FilledStep:
    rollout: Rollout  # [target*G] completions, informative groups first
    rewards: Rewards  # [target, G]
    extra_rounds: int  # sampling rounds beyond the first
    informative_groups: int  # informative groups in the step (== target unless the cap was hit)
    sampled_groups: int  # groups sampled this step, kept or not

    def metrics(self) -> dict[str, int]:
        return {
            "sampling/extra_rounds": self.extra_rounds,
            "sampling/informative_groups": self.informative_groups,
            "sampling/sampled_groups": self.sampled_groups,
        }


def informative_groups(rewards: Rewards, std_threshold: float) -> torch.Tensor:
    """[B] bool: groups whose reward spread can move the policy (the same test as A = 0)."""
    return rewards.for_advantages.std(dim=1) >= std_threshold


def fill_informative_groups(
    rollout: Rollout,
    rewards: Rewards,
    sample_round: Callable[[], tuple[Rollout, Rewards]],  # samples and scores one more batch of prompts
    target: int,
    max_rounds: int,
    std_threshold: float,
) -> FilledStep:
    kept: list[tuple[Rollout, Rewards, list[int]]] = []
    spare: list[tuple[Rollout, Rewards, list[int]]] = []
    found, rounds, sampled = 0, 0, 0
    errors: dict[str, str] = {}
    error_counts: dict[str, int] = {}
    while True:
        # Failures are reported for every round, even one whose groups are all dropped.
        errors = {**rewards.errors, **errors}
        for name, count in rewards.error_counts.items():
            error_counts[name] = error_counts.get(name, 0) + count
        flags = informative_groups(rewards, std_threshold).tolist()
        sampled += len(flags)
        useful = [group for group, flag in enumerate(flags) if flag][: target - found]
        kept.append((rollout, rewards, useful))
        spare.append((rollout, rewards, [group for group, flag in enumerate(flags) if not flag]))
        found += len(useful)
        if found >= target or rounds >= max_rounds:
            break
        rollout, rewards = sample_round()
        rounds += 1
    missing = target - found
    for part_rollout, part_rewards, groups in spare:
        if missing <= 0:
            break
        kept.append((part_rollout, part_rewards, groups[:missing]))
        missing -= len(groups[:missing])
    merged_rollout, merged_rewards = merge_groups([part for part in kept if part[2]])
    merged_rewards.errors, merged_rewards.error_counts = errors, error_counts
    return FilledStep(merged_rollout, merged_rewards, rounds, found, sampled)


def merge_groups(parts: list[tuple[Rollout, Rewards, list[int]]]) -> tuple[Rollout, Rewards]:
    """The chosen groups of several rounds' rollouts as one Rollout and one Rewards, in order."""
    group_size = parts[0][0].group_size
    rollouts, rewards = [], []
    for rollout, reward, groups in parts:
        rollouts.append(
            rollout.select([group * group_size + member for group in groups for member in range(group_size)])
        )
        rewards.append(_select_groups(reward, groups))
    merged_rewards = Rewards(
        total=torch.cat([r.total for r in rewards]),
        per_function={name: torch.cat([r.per_function[name] for r in rewards]) for name in rewards[0].per_function},
        errors={name: why for r in rewards for name, why in r.errors.items()},
        error_counts={name: sum(r.error_counts.get(name, 0) for r in rewards) for name in rewards[0].error_counts},
        shaped=None if rewards[0].shaped is None else torch.cat([r.shaped for r in rewards]),
    )
    return Rollout.concatenate(rollouts), merged_rewards


def _select_groups(rewards: Rewards, groups: list[int]) -> Rewards:
    index = torch.tensor(groups, dtype=torch.long)
    return Rewards(
        total=rewards.total[index],
        per_function={name: values[index] for name, values in rewards.per_function.items()},
        errors=dict(rewards.errors),
        error_counts=dict(rewards.error_counts),
        shaped=None if rewards.shaped is None else rewards.shaped[index],
    )
