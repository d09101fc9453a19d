"""What every sampler shares: which tokens belong to a completion, and the Rollout record built
from a batch of prompts and their sampled completion ids (pure functions, no model)."""

from __future__ import annotations

import torch

from grpo_cli.records import PromptBatch, Rollout


def completion_mask(completion_ids: torch.Tensor, eos_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of the tokens that belong to each completion, and which ones never ended.

    completion_ids: [N, T]. Returns (mask [N, T] long, 1 up to and including the first EOS;
    truncated [N] bool, True where no EOS appears). Example with EOS = 9:
        [[5, 9, 9],      ->  mask [[1, 1, 0],   truncated [False,
         [5, 6, 7]]               [1, 1, 1]]               True]
    """
    is_eos = completion_ids == eos_token_id
    # Number of EOS tokens strictly before each position: a token belongs to the completion
    # while that count is still 0.
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    mask = (eos_before == 0).long()
    truncated = ~is_eos.any(dim=1)
    return mask, truncated


def repeated_prompts(batch: PromptBatch, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's prompt ids and mask, each row `group` times side by side: [B*G, P] each."""
    return batch.input_ids.repeat_interleave(group, dim=0), batch.attention_mask.repeat_interleave(group, dim=0)


def rollout_from(
    batch: PromptBatch,
    group: int,
    completion_ids: torch.Tensor,
    tokenizer,
    temperature: float,
    prompt_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    sampler_log_probs: torch.Tensor | None = None,
) -> Rollout:
    """The Rollout of `group` completions per prompt of `batch`: completion_ids [B*G, T], rows
    grouped by prompt (each prompt's G completions side by side), as every sampler returns them.
    prompt_rows: repeated_prompts(batch, group), where the sampler has made them already;
    sampler_log_probs [B*G, T]: the sampler's log-probs of those tokens, where it has them."""
    mask, truncated = completion_mask(completion_ids, tokenizer.eos_token_id)
    prompt_ids, prompt_mask = prompt_rows if prompt_rows is not None else repeated_prompts(batch, group)
    return Rollout(
        prompt_ids=prompt_ids,  # [B*G, P]
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=mask,
        truncated=truncated,
        prompts=[text for text in batch.texts for _ in range(group)],
        completions=tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
        columns={key: [v for v in values for _ in range(group)] for key, values in batch.columns.items()},
        group_size=group,
        temperature=temperature,
        sampler_log_probs=sampler_log_probs,
    )
