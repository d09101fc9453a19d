"""Stage 2, group sampling: G completions per prompt from the current policy.

`make_sampler(cfg.sampler, tokenizer)` returns a `Sampler`: `HFSampler` (sampler.backend=hf,
transformers' `generate`) or `FastSampler` (sampler.backend=fast, our decode loop, the same
distribution).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from grpo_cli.config import SamplerConfig
from grpo_cli.records import PromptBatch, Rollout


@runtime_checkable
class Sampler(Protocol):
    """What the loop, the eval and grpo-filter ask of a rollout engine."""

    def sample(self, policy: torch.nn.Module, batch: PromptBatch, group_size: int | None = None) -> Rollout:
        """G completions per prompt of `batch` ([B*G] rows, each prompt's G side by side), drawn
        at sampler.temperature / top_k / top_p; G = sampler.group_size unless given."""
        ...

    def greedy(self, policy: torch.nn.Module, batch: PromptBatch) -> list[str]:
        """One greedy completion per prompt, as text (the eval)."""
        ...


# sampler=fast on a CPU packs a float32 linear weight for MKL's GEMM (fast.PackedLinears) when it
# has at least this many elements: smaller products run no faster packed (a [256, 128] weight:
# 39 against 41 us), and the packing's allocations cost more than they save (the tiny default's
# sampling took 3% longer with every weight packed). memory.py counts the same weights.
PACK_MIN_WEIGHTS = 1 << 17


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


def rollout_from(batch: PromptBatch, group: int, completion_ids: torch.Tensor, tokenizer, temperature: float,
                 prompt_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> Rollout:
    """The Rollout of `group` completions per prompt of `batch`: completion_ids [B*G, T], rows
    grouped by prompt (each prompt's G completions side by side), as both samplers return them.
    prompt_rows: repeated_prompts(batch, group), where the sampler has made them already."""
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
    )


def make_sampler(cfg: SamplerConfig, tokenizer, synced: bool = False,
                 autocast: torch.dtype | None = None) -> Sampler:
    """`synced`: keep every rank generating until all have finished (FSDP, distributed.py).
    `autocast`: sample under torch.autocast in this dtype (model.autocast; Models.autocast_dtype)."""
    if str(cfg.backend).lower() == "fast":
        from grpo_cli.sampling.fast import FastSampler

        return FastSampler(cfg, tokenizer, synced, autocast)
    from grpo_cli.sampling.hf import HFSampler

    return HFSampler(cfg, tokenizer, synced, autocast)
