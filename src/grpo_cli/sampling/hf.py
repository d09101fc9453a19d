"""Group sampling with transformers' `generate`: every prompt repeated G times, one batched call."""

from __future__ import annotations

import torch

from grpo_cli.config import SamplerConfig
from grpo_cli.models.loading import autocast_to
from grpo_cli.records import PromptBatch, Rollout
from grpo_cli.sampling.rollouts import repeated_prompts, rollout_from


class HFSampler:
    def __init__(self, cfg: SamplerConfig, tokenizer, synced: bool = False, autocast: torch.dtype | None = None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.autocast = autocast
        # FSDP: every rank must run the same number of forward passes (each gathers weights), so
        # a rank whose completions have all ended keeps stepping until every rank has.
        self.synced = synced

    def _generate(self, policy, input_ids, attention_mask, **options) -> torch.Tensor:
        """Completion ids [N, T] (T = max_new_tokens, EOS-padded past each completion's end)."""
        device = next(policy.parameters()).device
        was_training = policy.training
        policy.eval()  # no dropout while sampling; also lets gradient checkpointing use the KV cache
        try:
            with torch.no_grad(), autocast_to(self.autocast, device):
                output = policy.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attention_mask.to(device),
                    max_new_tokens=self.cfg.max_new_tokens,
                    pad_token_id=self.tokenizer.pad_token_id,
                    eos_token_id=self.tokenizer.eos_token_id,
                    use_cache=True,  # also under gradient checkpointing, which turns it off for training
                    synced_gpus=self.synced,
                    **options,
                )
        finally:
            policy.train(was_training)
        completions = output[:, input_ids.shape[1] :].cpu()
        # generate stops early when every row has finished; pad to a fixed width for the update.
        missing = self.cfg.max_new_tokens - completions.shape[1]
        if missing > 0:
            completions = torch.nn.functional.pad(completions, (0, missing), value=self.tokenizer.eos_token_id)
        return completions

    def sample(self, policy, batch: PromptBatch, group_size: int | None = None) -> Rollout:
        """G completions per prompt; G = sampler.group_size unless given (adaptive group size)."""
        group = group_size or self.cfg.group_size
        prompt_rows = repeated_prompts(batch, group)  # [B*G, P] each: generate encodes every copy
        completion_ids = self._generate(
            policy,
            *prompt_rows,
            do_sample=True,
            temperature=self.cfg.temperature,
            top_p=self.cfg.top_p,
            top_k=self.cfg.top_k,  # 0 disables top-k (None would mean the model default, often 50)
            min_new_tokens=self.cfg.min_new_tokens,
        )
        return rollout_from(batch, group, completion_ids, self.tokenizer, self.cfg.temperature, prompt_rows)

    def close(self) -> None:
        """Nothing to free: the sampler holds nothing beyond the policy."""

    def greedy(self, policy, batch: PromptBatch) -> list[str]:
        """One greedy completion per prompt (for eval)."""
        completion_ids = self._generate(policy, batch.input_ids, batch.attention_mask, do_sample=False)
        return self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
