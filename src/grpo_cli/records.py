"""The typed records that travel between the stages of one training step.

Shapes use B = prompts in the step, G = group size, P = padded prompt length, T = completion
length (at most sampler.max_new_tokens). Completion i of prompt b sits at row b * G + i.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch


@dataclass
class PromptBatch:
    texts: list[str]  # [B] prompt texts after the chat template / system prompt
    input_ids: torch.Tensor  # [B, P] left-padded
    attention_mask: torch.Tensor  # [B, P] 1 for prompt tokens, 0 for left padding
    columns: dict[str, list[Any]]  # each [B]: dataset fields (`answer`, ...) for the rewards
    messages: list[list[dict[str, Any]]] | None = None  # [B] each prompt's chat (multi-turn starts from it)

    @property
    def size(self) -> int:
        return len(self.texts)


@dataclass
class Rollout:
    prompt_ids: torch.Tensor  # [B*G, P] each prompt repeated G times
    prompt_mask: torch.Tensor  # [B*G, P]
    completion_ids: torch.Tensor  # [B*G, T] padded after EOS
    completion_mask: torch.Tensor  # [B*G, T] 1 up to and including the first EOS
    truncated: torch.Tensor  # [B*G] bool: no EOS within max_new_tokens
    prompts: list[str]  # [B*G]
    completions: list[str]  # [B*G] decoded, special tokens removed
    columns: dict[str, list[Any]]  # each [B*G]
    group_size: int
    temperature: float = 1.0  # sampled from softmax(logits / temperature): log-probs use the same
    # [B*G, T] float32: the sampler's own log-prob of each sampled token (0 after the end), from
    # the distribution it drew from; None where the sampler keeps none (fast, hf: the trainer's
    # own weights and kernels). The update measures the mismatch and corrects for it.
    sampler_log_probs: torch.Tensor | None = None
    # [B*G, T] 1 on the tokens the policy sampled. A multi-turn rollout's completion holds the
    # tool's, the environment's and the template's tokens between turns too (completion_mask 1:
    # attended); they are 0 here, so the loss, the KL, the entropy and the lengths leave them
    # out. None: every completion token is the policy's (completion_mask).
    policy_mask: torch.Tensor | None = None

    @property
    def trained_mask(self) -> torch.Tensor:  # [B*G, T] the policy's own tokens
        return self.completion_mask if self.policy_mask is None else self.policy_mask

    @property
    def num_prompts(self) -> int:
        return len(self.prompts) // self.group_size

    def select(self, rows: list[int]) -> Rollout:
        """The completions at `rows` (row b * G + i is completion i of prompt b), in that order."""
        index = torch.tensor(rows, dtype=torch.long)
        return replace(
            self,
            prompt_ids=self.prompt_ids[index],
            prompt_mask=self.prompt_mask[index],
            completion_ids=self.completion_ids[index],
            completion_mask=self.completion_mask[index],
            truncated=self.truncated[index],
            sampler_log_probs=None if self.sampler_log_probs is None else self.sampler_log_probs[index],
            policy_mask=None if self.policy_mask is None else self.policy_mask[index],
            prompts=[self.prompts[row] for row in rows],
            completions=[self.completions[row] for row in rows],
            columns={key: [values[row] for row in rows] for key, values in self.columns.items()},
        )

    @staticmethod
    def concatenate(parts: list[Rollout]) -> Rollout:
        """Rollouts of one step's sampling rounds as one, rows in order. Rounds were padded to
        different lengths: prompts are left-padded and completions right-padded to the longest,
        with id 0 and mask 0 (never attended, never in the loss)."""

        def padded(name: str, left: bool) -> torch.Tensor | None:
            tensors = [getattr(part, name) for part in parts]
            if all(tensor is None for tensor in tensors):
                return None
            if name == "policy_mask":  # a single-turn round among multi-turn ones: all its tokens
                tensors = [part.trained_mask for part in parts]
            elif any(tensor is None for tensor in tensors):  # sampler_log_probs of a sampler that keeps none
                return None
            length = max(tensor.shape[1] for tensor in tensors)
            sides = [(length - tensor.shape[1], 0) if left else (0, length - tensor.shape[1]) for tensor in tensors]
            return torch.cat([torch.nn.functional.pad(tensor, side) for tensor, side in zip(tensors, sides)])

        return replace(
            parts[0],
            prompt_ids=padded("prompt_ids", left=True),
            prompt_mask=padded("prompt_mask", left=True),
            completion_ids=padded("completion_ids", left=False),
            completion_mask=padded("completion_mask", left=False),
            truncated=torch.cat([part.truncated for part in parts]),
            sampler_log_probs=padded("sampler_log_probs", left=False),
            policy_mask=padded("policy_mask", left=False),
            prompts=[text for part in parts for text in part.prompts],
            completions=[text for part in parts for text in part.completions],
            columns={key: [value for part in parts for value in part.columns[key]] for key in parts[0].columns},
        )


@dataclass
class Rewards:
    total: torch.Tensor  # [B, G] weighted sum over functions (clipped by reward.clip; None counts 0)
    per_function: dict[str, torch.Tensor]  # name -> [B, G], NaN where the function returned None
    errors: dict[str, str] = field(default_factory=dict)  # name -> why its first failure happened this step
    error_counts: dict[str, int] = field(default_factory=dict)  # name -> completions whose score was lost
    shaped: torch.Tensor | None = None  # [B, G] what advantages are computed from (reward.normalize_each); None = total

    @property
    def for_advantages(self) -> torch.Tensor:  # [B, G]
        return self.total if self.shaped is None else self.shaped


@dataclass
class Advantages:
    values: torch.Tensor  # [B*G] one advantage per completion, shared by all its tokens
    zero_std_groups: torch.Tensor  # [B] bool: groups with no reward spread (A = 0)


@dataclass
class UpdateStats:
    """Plain floats for logging, averaged over the micro-batches and iterations of one step.
    None where the step had no token in the loss (nothing was measured)."""

    loss: float
    kl: float | None  # mean per-token KL(pi || ref) estimate (trainer.kl_estimator); 0 without a reference
    clip_fraction: float | None  # fraction of loss tokens whose ratio was clipped (either side), all passes
    clip_high_fraction: float | None  # ... clipped at 1 + clip_eps_high (A > 0)
    clip_low_fraction: float | None  # ... clipped at 1 - clip_eps (A < 0)
    clip_fraction_by_pass: list[float]  # [num_iterations]
    ratio_deviation_by_pass: list[float]  # [num_iterations] max |pi/pi_old - 1| over loss tokens
    entropy: float | None  # mean per-token entropy of the policy on its own completions
    logprob_mismatch: float | None  # mean |log pi_trainer - log pi_sampler| over loss tokens (None: none kept)
    logprob_mismatch_max: float | None  # ... its max
    corrected_fraction: float | None  # loss tokens whose rollout-correction ratio passed the cap
    grad_norm: float  # global gradient norm before clipping (last optimizer step)
    tokens: int  # completion tokens in the loss
    skipped_steps: int  # optimizer steps not taken: gradient not finite, or no token in the loss
    entropy_kept_fraction: float | None = None  # loss tokens kept by trainer.top_entropy_quantile (None: off)

    @classmethod
    def nothing_trained(cls, passes: int) -> UpdateStats:
        """A step with no token in the loss: no optimizer step (AdamW's momentum would still
        move the weights), every pass counted as skipped."""
        return cls(
            loss=0.0,
            kl=None,
            clip_fraction=None,
            clip_high_fraction=None,
            clip_low_fraction=None,
            clip_fraction_by_pass=[],
            ratio_deviation_by_pass=[],
            entropy=None,
            logprob_mismatch=None,
            logprob_mismatch_max=None,
            corrected_fraction=None,
            grad_norm=0.0,
            tokens=0,
            skipped_steps=passes,
        )
