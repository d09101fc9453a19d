"""Stage 2, group sampling: G completions per prompt from the current policy.

`make_sampler(cfg.sampler, tokenizer)` returns a `Sampler`: `HFSampler` (sampler.backend=hf,
transformers' `generate`), `FastSampler` (sampler.backend=fast, our decode loop, the same
distribution) or `VLLMSampler` (sampler.backend=vllm, a vLLM engine in this process, given its
EngineSpec). What they share (the completion mask, the Rollout they build) is in rollouts.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from grpo_cli.config import SamplerConfig
from grpo_cli.records import PromptBatch, Rollout

if TYPE_CHECKING:
    from grpo_cli.models.loading import Models
    from grpo_cli.sampling.vllm import EngineSpec


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

    def close(self) -> None:
        """Free what the sampler holds beyond the policy (vLLM: its engine); the run's end."""
        ...


def make_sampler(
    cfg: SamplerConfig,
    tokenizer,
    synced: bool = False,
    autocast: torch.dtype | None = None,
    engine: EngineSpec | None = None,
) -> Sampler:
    """`synced`: keep every rank generating until all have finished (FSDP, distributed.py).
    `autocast`: sample under torch.autocast in this dtype (model.autocast; Models.autocast_dtype).
    `engine`: sampler=vllm's engine (sampling.vllm.engine_spec; run_sampler makes it)."""
    backend = str(cfg.backend).lower()
    if backend == "fast":
        from grpo_cli.sampling.fast import FastSampler

        return FastSampler(cfg, tokenizer, synced, autocast)
    if backend == "vllm":
        from grpo_cli.sampling.vllm import VLLMSampler

        if engine is None:
            raise ValueError("sampler.backend=vllm: make_sampler needs the engine's EngineSpec (see run_sampler)")
        return VLLMSampler(cfg, tokenizer, engine)
    from grpo_cli.sampling.hf import HFSampler

    return HFSampler(cfg, tokenizer, synced, autocast)


def run_sampler(cfg: Any, models: Models, rows: list[dict[str, Any]], synced: bool = False) -> Sampler:
    """The sampler of a run of `cfg` with `models`, whose prompts are `rows` (train and eval):
    for sampler=vllm, its engine is sized to the longest of them."""
    from grpo_cli.config import is_multi_turn
    from grpo_cli.multiturn.rollout import MultiTurnSampler

    engine = None
    if str(cfg.sampler.backend).lower() == "vllm":
        from grpo_cli.data.prompts import prompt_lengths
        from grpo_cli.sampling.vllm import engine_spec

        longest = max(prompt_lengths(cfg.data, rows, models.tokenizer), default=1)
        if is_multi_turn(cfg.get("rollout")):  # a later turn's prompt holds the earlier turns too
            longest += int(cfg.rollout.max_total_tokens)
        engine = engine_spec(cfg, models.device, models.autocast_dtype, longest)
    sampler = make_sampler(cfg.sampler, models.tokenizer, synced, models.autocast_dtype, engine)
    if is_multi_turn(cfg.get("rollout")):  # rollout.tools / rollout.environment: the sampler draws each turn
        return MultiTurnSampler(sampler, cfg.rollout, models.tokenizer)
    return sampler
