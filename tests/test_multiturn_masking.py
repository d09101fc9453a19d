"""A multi-turn rollout's tool and template tokens are context, not the policy's: they get no
gradient, no KL and no entropy, and do not count as tokens trained on."""

from __future__ import annotations

import torch

from helpers import config, one_step

TOOL_COLUMNS = slice(2, 5)  # a "tool result" between the policy's first 2 tokens and its last 3


def mark_tool_tokens(rollout):
    """Every row: 8 attended completion tokens, the policy's at 0-1 and 5-7, a tool's at 2-4."""
    rollout.completion_mask = torch.ones_like(rollout.completion_ids)
    rollout.truncated = torch.zeros_like(rollout.truncated)
    policy_mask = torch.ones_like(rollout.completion_ids)
    policy_mask[:, TOOL_COLUMNS] = 0
    rollout.policy_mask = policy_mask


def gradient_by_token(monkeypatch):
    """Patches the update's loss so that the gradient of the step's loss with respect to each
    token's log-prob ([rows, T], summed over micro-batches in order) is kept in the list returned."""
    import grpo_cli.algorithm.update as update

    kept: list[torch.Tensor] = []
    original = update.grpo_loss

    def recording(log_probs, *rest, **kwargs):
        log_probs.register_hook(lambda grad: kept.append(grad.detach().clone()))
        return original(log_probs, *rest, **kwargs)

    monkeypatch.setattr(update, "grpo_loss", recording)
    return kept


def test_tool_tokens_get_no_gradient_and_the_policys_do(tiny_model_dir, monkeypatch):
    gradients = gradient_by_token(monkeypatch)
    settings = ("trainer.beta=0.04", "sampler.max_new_tokens=8", "trainer.entropy_coef=0.01")
    masked = one_step(config(tiny_model_dir, *settings), mark_tool_tokens)
    (by_token,) = gradients
    assert by_token.shape[1] == 8
    assert torch.count_nonzero(by_token[:, TOOL_COLUMNS]) == 0  # not the loss, the KL or the entropy bonus
    assert torch.count_nonzero(by_token[:, :2]) > 0 and torch.count_nonzero(by_token[:, 5:]) > 0
    assert masked.stats.tokens == 8 * 5  # the policy's 5 tokens a row are what was trained on

    def tool_tokens_trained(rollout):  # the same rollout, its tool tokens left in the loss
        mark_tool_tokens(rollout)
        rollout.policy_mask = None

    gradients.clear()
    unmasked = one_step(config(tiny_model_dir, *settings), tool_tokens_trained)
    (with_tools,) = gradients
    assert torch.count_nonzero(with_tools[:, TOOL_COLUMNS]) > 0  # the check above can fail
    assert unmasked.stats.tokens == 8 * 8
