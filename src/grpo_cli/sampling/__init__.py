"""Stage 2, group sampling: G completions per prompt from the current policy.

`make_sampler(cfg.sampler, tokenizer)` returns a `Sampler`: `HFSampler` (sampler.backend=hf,
transformers' `generate`) or `FastSampler` (sampler.backend=fast, our decode loop, the same
distribution). What both share (the completion mask, the Rollout they build) is in rollouts.py.
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


def make_sampler(cfg: SamplerConfig, tokenizer, synced: bool = False, autocast: torch.dtype | None = None) -> Sampler:
    """`synced`: keep every rank generating until all have finished (FSDP, distributed.py).
    `autocast`: sample under torch.autocast in this dtype (model.autocast; Models.autocast_dtype)."""
    if str(cfg.backend).lower() == "fast":
        from grpo_cli.sampling.fast import FastSampler

        return FastSampler(cfg, tokenizer, synced, autocast)
    from grpo_cli.sampling.hf import HFSampler

    return HFSampler(cfg, tokenizer, synced, autocast)
