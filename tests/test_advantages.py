import math

import torch

from grpo_cli.algorithm.advantages import group_advantages


def test_group_size_two_gives_plus_minus_one_over_sqrt_two():
    # rewards (1, 0): mean 0.5, sample std sqrt(((0.5)^2 + (0.5)^2) / 1) = 0.70711,
    # A = +-0.5 / 0.70711 = +-0.70711 (eps = 0 here).
    result = group_advantages(torch.tensor([[1.0, 0.0]]), std_eps=0.0, std_threshold=1e-4)
    expected = 1 / math.sqrt(2)
    assert torch.allclose(result.values, torch.tensor([expected, -expected]), atol=1e-6)
    assert result.zero_std_groups.tolist() == [False]


def test_each_group_is_normalized_on_its_own_and_flattened_row_major():
    # group 0: (1, 2, 3): mean 2, sample std 1 -> (-1, 0, 1)
    # group 1: (10, 10, 40): mean 20, std sqrt((100 + 100 + 400) / 2) = sqrt(300) = 17.3205
    #          -> (-10, -10, 20) / 17.3205 = (-0.57735, -0.57735, 1.15470)
    rewards = torch.tensor([[1.0, 2.0, 3.0], [10.0, 10.0, 40.0]])
    result = group_advantages(rewards, std_eps=0.0, std_threshold=1e-4)
    expected = torch.tensor([-1.0, 0.0, 1.0, -0.57735, -0.57735, 1.15470])
    assert torch.allclose(result.values, expected, atol=1e-5)


def test_eps_is_added_to_the_std():
    # (1, 0) with eps 0.29289: std + eps = 0.70711 + 0.29289 = 1.0, so A = (+0.5, -0.5).
    result = group_advantages(torch.tensor([[1.0, 0.0]]), std_eps=1 - 1 / math.sqrt(2), std_threshold=1e-4)
    assert torch.allclose(result.values, torch.tensor([0.5, -0.5]), atol=1e-6)


def test_zero_std_groups_get_exactly_zero_and_are_flagged():
    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.50001]])
    result = group_advantages(rewards, std_eps=1e-4, std_threshold=1e-4)
    # group 2 has std 5e-6 < threshold: no signal, so no update, instead of 1e-5 / 1e-4 noise.
    assert result.zero_std_groups.tolist() == [True, False, True]
    values = result.values.view(3, 4)
    assert torch.equal(values[0], torch.zeros(4)) and torch.equal(values[2], torch.zeros(4))
    assert values[1].abs().sum() > 0
    # group 1: (0, 1, 0, 0): mean 0.25, std sqrt((3 * 0.0625 + 0.5625) / 3) = 0.5
    assert torch.allclose(values[1], torch.tensor([-0.5, 1.5, -0.5, -0.5]), atol=1e-3)


def test_advantages_sum_to_zero_within_each_group():
    rewards = torch.rand(5, 8)
    values = group_advantages(rewards, std_eps=1e-4, std_threshold=1e-4).values.view(5, 8)
    assert torch.allclose(values.sum(dim=1), torch.zeros(5), atol=1e-5)
