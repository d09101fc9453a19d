"""Each advantage mode of group_advantages, and combine_rewards, on small cases worked by hand.

grpo       A_i = (r_i - mean) / (sample std + eps)
rloo       A_i = r_i - mean of the other G - 1 rewards = G / (G - 1) * (r_i - mean)
dr_grpo    A_i = r_i - mean
batch_std  A_i = (r_i - group mean) / (sample std of all B*G rewards + eps)
reinforce_baseline  A_i = c_i / (sample std of all B*G c + eps), c_i = r_i - group mean
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_cli.algorithm.advantages import group_advantages
from grpo_cli.rewards.shaping import combine_rewards

NO_EPS = dict(std_eps=0.0, std_threshold=1e-4)


def advantages(rewards: list[list[float]], mode: str, **settings) -> list[float]:
    return group_advantages(
        torch.tensor(rewards, dtype=torch.float32), mode=mode, **(settings or NO_EPS)
    ).values.tolist()


# ---------------------------------------------------------------- group_advantages, mode by mode


def test_grpo_on_a_two_of_four_group():
    # (1, 0, 0, 1): mean 0.5, centered (0.5, -0.5, -0.5, 0.5),
    # sample std sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.57735 -> A = +-0.5 / 0.57735 = +-0.866025
    assert advantages([[1, 0, 0, 1]], "grpo") == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-6)


def test_rloo_subtracts_the_mean_of_the_other_rewards():
    # (1, 0, 0, 1): r_0 = 1, others (0, 0, 1) mean 1/3 -> 2/3; r_1 = 0, others (1, 0, 1) mean 2/3 -> -2/3
    # equivalently G/(G-1) (r - mean) = 4/3 * +-0.5 = +-0.666667
    assert advantages([[1, 0, 0, 1]], "rloo") == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3], abs=1e-6)
    # (1, 2, 3): 1 - mean(2, 3) = -1.5; 2 - mean(1, 3) = 0; 3 - mean(1, 2) = 1.5  (= 3/2 * (-1, 0, 1))
    assert advantages([[1, 2, 3]], "rloo") == pytest.approx([-1.5, 0.0, 1.5], abs=1e-6)


def test_dr_grpo_only_centers():
    # no division by the std: (1, 0, 0, 1) - 0.5 and (1, 2, 3) - 2
    assert advantages([[1, 0, 0, 1]], "dr_grpo") == pytest.approx([0.5, -0.5, -0.5, 0.5], abs=1e-6)
    assert advantages([[1, 2, 3]], "dr_grpo") == pytest.approx([-1.0, 0.0, 1.0], abs=1e-6)
    # a group on a 10x scale keeps its 10x advantages (grpo would make both identical)
    assert advantages([[10, 20, 30]], "dr_grpo") == pytest.approx([-10.0, 0.0, 10.0], abs=1e-5)


def test_batch_std_centers_per_group_but_scales_by_the_whole_batch():
    # groups (0, 2) and (10, 14): group means 1 and 12 -> centered (-1, 1) and (-2, 2).
    # their own stds are sqrt(2) and sqrt(8), so grpo gives +-0.7071 in both.
    # all four rewards (0, 2, 10, 14): mean 6.5, squared deviations 42.25 + 20.25 + 12.25 + 56.25 = 131,
    # sample std sqrt(131 / 3) = 6.608076 -> (-1, 1, -2, 2) / 6.608076
    rewards = [[0, 2], [10, 14]]
    assert advantages(rewards, "batch_std") == pytest.approx([-0.151330, 0.151330, -0.302660, 0.302660], abs=1e-6)
    assert advantages(rewards, "grpo") == pytest.approx([-0.707107, 0.707107, -0.707107, 0.707107], abs=1e-6)


def test_batch_std_adds_eps_to_the_batch_std():
    # (0, 2), (10, 14) with eps 1: (-1, 1, -2, 2) / (6.608076 + 1) = (-1, 1, -2, 2) / 7.608076
    values = advantages([[0, 2], [10, 14]], "batch_std", std_eps=1.0, std_threshold=1e-4)
    assert values == pytest.approx([-0.131440, 0.131440, -0.262879, 0.262879], abs=1e-6)


def test_reinforce_baseline_scales_by_the_std_of_the_centered_rewards_not_the_raw_ones():
    # groups (0, 2) and (10, 14) again, centered (-1, 1, -2, 2): mean 0, squares 1 + 1 + 4 + 4 = 10,
    # sample std sqrt(10 / 3) = 1.825742 -> (-1, 1, -2, 2) / 1.825742. The gap between the groups'
    # means (1 and 12), which batch_std's raw std of 6.608 carries, is not in it.
    rewards = [[0, 2], [10, 14]]
    expected = [-0.547723, 0.547723, -1.095445, 1.095445]
    assert advantages(rewards, "reinforce_baseline") == pytest.approx(expected, abs=1e-6)
    # shifting one group by a constant changes batch_std's advantages, not these
    shifted = [[0, 2], [110, 114]]
    assert advantages(shifted, "reinforce_baseline") == pytest.approx(expected, abs=1e-5)
    assert advantages(shifted, "batch_std") != pytest.approx(advantages(rewards, "batch_std"), abs=1e-3)


@pytest.mark.parametrize("mode", ["grpo", "rloo", "dr_grpo", "batch_std", "reinforce_baseline"])
def test_zero_std_groups_are_flagged_and_exactly_zero_in_every_mode(mode):
    # group 0 constant; group 2 nearly constant: (0.5, 0.5, 0.50001) has sample std ~5.8e-6 < 1e-4,
    # so its tiny centered rewards (which rloo / dr_grpo / batch_std would keep) are zeroed too.
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 2.0], [0.5, 0.5, 0.50001]])
    result = group_advantages(rewards, std_eps=1e-4, std_threshold=1e-4, mode=mode)
    assert result.zero_std_groups.tolist() == [True, False, True]
    values = result.values.view(3, 3)
    assert torch.equal(values[0], torch.zeros(3))
    assert torch.equal(values[2], torch.zeros(3))
    # the group with a spread keeps an antisymmetric, non-zero signal
    assert values[1, 0].item() < 0 < values[1, 2].item()
    assert values[1, 1].item() == pytest.approx(0.0, abs=1e-6)


def test_unknown_mode_raises():
    with pytest.raises(ValueError, match="unknown advantage mode"):
        group_advantages(torch.tensor([[1.0, 0.0]]), std_eps=1e-4, std_threshold=1e-4, mode="ppo")


# ---------------------------------------------------------------- combine_rewards


def test_plain_sum_treats_nan_as_no_opinion():
    # f = (1, NaN), g = (NaN, 2), weights 1 and 3: (1 + 0, 0 + 3 * 2) = (1, 6)
    total = combine_rewards(
        {"f": torch.tensor([[1.0, math.nan]]), "g": torch.tensor([[math.nan, 2.0]])}, {"f": 1.0, "g": 3.0}
    )
    assert total.tolist() == [[1.0, 6.0]]


def test_clip_applies_to_each_function_before_its_weight():
    # f = (5, -3, 0.5, NaN) clamped to [-1, 1]: (1, -1, 0.5, NaN), weight 2: (2, -2, 1, 0)
    # (weighting first would give (10, -6, 1) -> clamp (1, -1, 1): the order matters)
    # g = (NaN, 0.2, 0.3, 0.4) inside the range, weight 1
    # total (2 + 0, -2 + 0.2, 1 + 0.3, 0 + 0.4) = (2, -1.8, 1.3, 0.4)
    total = combine_rewards(
        {"f": torch.tensor([[5.0, -3.0, 0.5, math.nan]]), "g": torch.tensor([[math.nan, 0.2, 0.3, 0.4]])},
        {"f": 2.0, "g": 1.0},
        clip=(-1.0, 1.0),
    )
    assert total.tolist() == [pytest.approx([2.0, -1.8, 1.3, 0.4], abs=1e-6)]


def test_normalize_each_docstring_example():
    # one group, f = (0, 10), g = (1, 0), weights 1.
    # plain: (0 + 1, 10 + 0) = (1, 10)
    # f: mean 5, sample std sqrt(25 + 25) = 7.0711 -> -+5 / (7.0711 + 1e-4) = -+0.707097
    # g: mean 0.5, std 0.70711 -> +-0.5 / (0.70711 + 1e-4) = +-0.707007
    # sum (-0.000090, +0.000090): zero up to std_eps
    scores = {"f": torch.tensor([[0.0, 10.0]]), "g": torch.tensor([[1.0, 0.0]])}
    weights = {"f": 1.0, "g": 1.0}
    assert combine_rewards(scores, weights).tolist() == [[1.0, 10.0]]
    normalized = combine_rewards(scores, weights, normalize_each=True)
    assert normalized.tolist() == [pytest.approx([-0.000090, 0.000090], abs=2e-6)]
    assert normalized.abs().max().item() < 2e-4


def test_normalize_each_stops_a_large_scale_function_from_dominating():
    # f = (0, 100, 200) on a 0..200 scale, g = (1, 0, 0) a 0/1 correctness.
    # plain sum (1, 100, 200): completion 0, the only correct one, ranks last.
    # f: mean 100, std 100 -> (-1, 0, 1)
    # g: mean 1/3, deviations (2/3, -1/3, -1/3), std sqrt((4/9 + 1/9 + 1/9) / 2) = 0.57735
    #    -> (1.154701, -0.577350, -0.577350) (1.154501 / -0.577250 with eps 1e-4)
    # normalized sum (0.154501, -0.577250, 0.422750): completion 0 now beats completion 1
    scores = {"f": torch.tensor([[0.0, 100.0, 200.0]]), "g": torch.tensor([[1.0, 0.0, 0.0]])}
    weights = {"f": 1.0, "g": 1.0}
    plain = combine_rewards(scores, weights)[0]
    normalized = combine_rewards(scores, weights, normalize_each=True)[0]
    assert plain[0] < plain[1] < plain[2]
    assert normalized.tolist() == pytest.approx([0.154501, -0.577250, 0.422750], abs=1e-5)
    assert normalized[0] > normalized[1]


def test_normalize_each_gives_zero_for_a_constant_function():
    # f constant in its group -> z = 0 / (0 + eps) = 0; only g = (0, 10) -> (-0.707097, 0.707097) remains
    total = combine_rewards(
        {"f": torch.tensor([[7.0, 7.0]]), "g": torch.tensor([[0.0, 10.0]])}, {"f": 5.0, "g": 1.0}, normalize_each=True
    )
    assert total.tolist() == [pytest.approx([-0.707097, 0.707097], abs=1e-6)]


def test_normalize_each_counts_nan_as_the_group_mean():
    # f = (0, NaN, 10): mean and std over the present (0, 10) only: mean 5, std 7.0711
    # -> (-0.707097, NaN -> z = 0, 0.707097). (NaN read as 0 would give mean 10/3 and a non-zero middle.)
    total = combine_rewards({"f": torch.tensor([[0.0, math.nan, 10.0]])}, {"f": 1.0}, normalize_each=True)
    assert total.tolist() == [pytest.approx([-0.707097, 0.0, 0.707097], abs=1e-6)]
    # a group where the function has no opinion at all contributes 0
    silent = combine_rewards({"f": torch.tensor([[math.nan, math.nan]])}, {"f": 1.0}, normalize_each=True)
    assert silent.tolist() == [[0.0, 0.0]]


def test_normalize_each_weights_after_normalizing_and_per_group():
    # z-scores do not see a weight applied before them; applied after, weight 3 triples them:
    # f = (0, 10) -> 3 * (-0.707097, 0.707097) = (-2.121291, 2.121291).
    # the second group (100, 300) is z-scored on its own: mean 200, std 141.421 -> same (-+0.707106) * 3
    total = combine_rewards({"f": torch.tensor([[0.0, 10.0], [100.0, 300.0]])}, {"f": 3.0}, normalize_each=True)
    assert total.tolist() == [
        pytest.approx([-2.121291, 2.121291], abs=1e-5),
        pytest.approx([-2.121318, 2.121318], abs=1e-5),
    ]


def trl_normalize_then_sum(per_function: list[list[list[float]]], weights: list[float]) -> list[float]:
    """TRL 1.16's multi_objective_aggregation="normalize_then_sum" (GDPO), transcribed: each
    function's z-score within its group (sample std + 1e-4), the weighted sum (NaN as 0), then
    (R - mean over the batch) / (std over the batch + 1e-4). per_function[k][b][g]."""
    groups, size = len(per_function[0]), len(per_function[0][0])
    totals = []
    for b in range(groups):
        for g in range(size):
            total = 0.0
            for k, scores in enumerate(per_function):
                row = [x for x in scores[b] if not math.isnan(x)]
                mean = sum(row) / len(row)
                std = math.sqrt(sum((x - mean) ** 2 for x in row) / (len(row) - 1))
                value = scores[b][g]
                total += 0.0 if math.isnan(value) else weights[k] * (value - mean) / (std + 1e-4)
            totals.append(total)
    mean = sum(totals) / len(totals)
    std = math.sqrt(sum((x - mean) ** 2 for x in totals) / (len(totals) - 1))
    return [(x - mean) / (std + 1e-4) for x in totals]


def test_normalize_then_sum_is_normalize_each_with_the_batch_std():
    # TRL's GDPO aggregation equals ours: reward.normalize_each=true, trainer.advantage=batch_std
    # (the summed z-scores have group mean 0, so centring by group or by batch is the same).
    generator = torch.Generator().manual_seed(3)
    accuracy = (torch.rand(3, 4, generator=generator) > 0.5).float()
    accuracy[0] = torch.tensor([1.0, 0.0, 0.0, 1.0])
    length = torch.randn(3, 4, generator=generator) * 50
    length[1, 2] = math.nan  # no opinion
    weights = {"accuracy": 1.0, "length": 0.3}
    shaped = combine_rewards({"accuracy": accuracy, "length": length}, weights, normalize_each=True)
    ours = group_advantages(shaped, std_eps=1e-4, std_threshold=1e-6, mode="batch_std").values
    expected = trl_normalize_then_sum([accuracy.tolist(), length.tolist()], [1.0, 0.3])
    assert ours.tolist() == pytest.approx(expected, abs=1e-5)


def test_normalize_then_sum_by_its_trl_name_sets_both_keys():
    from omegaconf import OmegaConf

    from grpo_cli.config import Config, advantage_mode, normalizes_each

    cfg = OmegaConf.structured(Config)
    assert not normalizes_each(cfg.reward) and advantage_mode(cfg) == "grpo"
    cfg.reward.multi_objective_aggregation = "normalize_then_sum"
    assert normalizes_each(cfg.reward) and advantage_mode(cfg) == "batch_std"
