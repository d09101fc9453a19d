"""Stage 5, the policy update: micro-batches, mu iterations, gradient clipping, optimizer step.

One generation batch (B*G completions) is trained on `num_iterations` times (the paper's mu).
Reference log-probs, and with mu > 1 the old policy's log-probs, are computed once before the
first pass, so later passes see a real ratio pi_theta / pi_old and the clip can bite. Each pass
accumulates gradients over micro-batches of `micro_batch_size` completions and ends in one
optimizer step; a step whose gradient is not finite is skipped (never reaches the weights).

Under torchrun (distributed.py) each rank trains on its share of the step: the loss
denominators count the whole step over all ranks, each rank's loss is scaled by the number of
ranks (DDP and FSDP average gradients), and the statistics are summed over ranks, so the
gradient and the numbers equal those of one process training on the whole step.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from grpo_cli.algorithm.log_probs import completion_log_probs
from grpo_cli.algorithm.losses import (
    LossDenominators,
    LossSettings,
    RolloutCorrection,
    grpo_loss,
    log_prob_mismatch,
    rollout_weights,
)
from grpo_cli.config import TrainerConfig
from grpo_cli.distributed import ONE_PROCESS, World, max_over_ranks, sum_over_ranks
from grpo_cli.models.cpu_gemm import OneDnnLinears
from grpo_cli.models.loading import Models, reference_model, trainable_parameters
from grpo_cli.records import Advantages, Rollout, UpdateStats


class MicroBatch(NamedTuple):
    """The rows of one forward/backward, cut to the columns they use: left padding that none of
    its prompts has a token in, and positions after its longest completion's end (nothing
    attends to either, and nothing there is scored)."""

    prompt_ids: torch.Tensor  # [n, p] p <= P
    prompt_mask: torch.Tensor  # [n, p]
    completion_ids: torch.Tensor  # [n, t] t <= T: the longest completion of these rows
    mask: torch.Tensor  # [n, t] completion tokens (1 up to and including EOS)
    loss_mask: torch.Tensor  # [n, t] the tokens in the loss (the policy's own, less truncated ones: mask_truncated)
    advantages: torch.Tensor  # [n]
    sampler_log_probs: torch.Tensor | None  # [n, t] the sampler's own log-probs (Rollout.sampler_log_probs)
    prompt_pass_group: int = 1  # G where one prompt pass serves each group of G rows (whole groups), else 1
    policy_mask: torch.Tensor | None = None  # [n, t] the policy's own tokens (multi-turn); None = mask

    @property
    def policy_tokens(self) -> torch.Tensor:  # [n, t] the policy's tokens, truncated or not
        return self.mask if self.policy_mask is None else self.policy_mask


def micro_batch(
    rows: slice | torch.Tensor,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    mask: torch.Tensor,
    loss_mask: torch.Tensor,
    advantages: torch.Tensor,
    sampler_log_probs: torch.Tensor | None = None,
    prompt_pass_group: int = 1,
    policy_mask: torch.Tensor | None = None,
) -> MicroBatch:
    """MicroBatch of `rows` (a slice or row indices; [N, P] prompts, left-padded; [N, T]
    completions). Example: prompts [[0, 0, 5], [0, 6, 7]] keep their last two columns;
    completion masks [[1, 0, 0], [1, 1, 0]] their first two."""
    used = prompt_mask[rows].any(dim=0)  # [P]
    first = int(used.to(torch.uint8).argmax()) if bool(used.any()) else 0
    width = max(int(mask[rows].sum(dim=1).max()), 1)  # the mask runs from position 0 to the EOS
    return MicroBatch(
        prompt_ids[rows, first:],
        prompt_mask[rows, first:],
        completion_ids[rows, :width],
        mask[rows, :width],
        loss_mask[rows, :width],
        advantages[rows],
        None if sampler_log_probs is None else sampler_log_probs[rows, :width],
        prompt_pass_group,
        None if policy_mask is None else policy_mask[rows, :width],
    )


@dataclass
class StepTotals:
    """What the micro-batches of every pass add up, this rank's share until `over_ranks`."""

    loss: float = 0.0  # the step's loss, summed over passes
    kl_sum: float = 0.0  # over loss tokens, all passes
    clipped_high: float = 0.0  # loss tokens clipped at 1 + clip_eps_high, all passes
    clipped_low: float = 0.0  # ... at 1 - clip_eps
    tokens: float = 0.0  # loss tokens, all passes
    entropy_kept: float = 0.0  # ... of them kept by the entropy mask (top_entropy_quantile), all passes
    entropy_masked: bool = False  # whether top_entropy_quantile < 1 (entropy_kept is then logged)
    entropy_sum: float = 0.0  # first pass, over every token of the policy's (truncated or not)
    entropy_tokens: float = 0.0
    mismatch_sum: float = 0.0  # first pass, over loss tokens: |log pi_trainer - log pi_sampler|
    mismatch_tokens: float = 0.0  # the loss tokens it was measured on (0: the sampler keeps no log-probs)
    corrected_tokens: float = 0.0  # ... of them truncated or masked by the rollout correction
    mismatch_max: float = 0.0
    clipped_by_pass: list[float] = field(default_factory=list)  # [passes]
    tokens_by_pass: list[float] = field(default_factory=list)  # [passes]
    deviation_by_pass: list[float] = field(default_factory=list)  # [passes] max |ratio - 1|

    SUMMED = (
        "loss",
        "kl_sum",
        "clipped_high",
        "clipped_low",
        "tokens",
        "entropy_kept",
        "entropy_sum",
        "entropy_tokens",
        "mismatch_sum",
        "mismatch_tokens",
        "corrected_tokens",
    )

    def add(self, loss: float, metrics: dict) -> None:
        """One micro-batch of the current pass (the last one started with `start_pass`)."""
        self.loss += loss
        for key in ("kl_sum", "clipped_high", "clipped_low", "tokens", "entropy_kept"):
            setattr(self, key, getattr(self, key) + float(metrics[key]))
        self.clipped_by_pass[-1] += float(metrics["clipped_high"] + metrics["clipped_low"])
        self.tokens_by_pass[-1] += float(metrics["tokens"])
        self.deviation_by_pass[-1] = max(self.deviation_by_pass[-1], float(metrics["ratio_max_deviation"]))

    def add_entropy(self, entropy_sum: float, tokens: float) -> None:
        self.entropy_sum += entropy_sum
        self.entropy_tokens += tokens

    def add_mismatch(self, old_log_probs: torch.Tensor, batch: MicroBatch, correction: RolloutCorrection) -> None:
        """The sampler's log-probs of `batch` against the trainer's at the weights that sampled."""
        gap_sum, gap_max = log_prob_mismatch(old_log_probs, batch.sampler_log_probs, batch.loss_mask)
        self.mismatch_sum += gap_sum.item()
        self.mismatch_max = max(self.mismatch_max, gap_max.item())
        self.mismatch_tokens += float(batch.loss_mask.sum())
        self.corrected_tokens += float(correction.capped.sum())

    def start_pass(self) -> None:
        self.clipped_by_pass.append(0.0)
        self.tokens_by_pass.append(0.0)
        self.deviation_by_pass.append(0.0)

    def over_ranks(self, world: World) -> StepTotals:
        """The whole step's totals: sums (the deviation: the max) over torchrun ranks, in one
        all-reduce; the identity in one process."""
        passes = len(self.clipped_by_pass)
        summed = sum_over_ranks(
            [getattr(self, name) for name in self.SUMMED] + self.clipped_by_pass + self.tokens_by_pass, world
        )
        per_pass = summed[len(self.SUMMED) :]
        return StepTotals(
            **dict(zip(self.SUMMED, summed)),
            clipped_by_pass=per_pass[:passes],
            tokens_by_pass=per_pass[passes:],
            deviation_by_pass=max_over_ranks(self.deviation_by_pass, world),
            mismatch_max=max_over_ranks([self.mismatch_max], world)[0],
            entropy_masked=self.entropy_masked,
        )

    def stats(self, grad_norm: float, loss_tokens: int, skipped: int) -> UpdateStats:
        passes = max(len(self.clipped_by_pass), 1)
        tokens = max(self.tokens, 1.0)
        measured = self.mismatch_tokens > 0
        return UpdateStats(
            loss=self.loss / passes,
            kl=self.kl_sum / tokens,
            clip_fraction=(self.clipped_high + self.clipped_low) / tokens,
            clip_high_fraction=self.clipped_high / tokens,
            clip_low_fraction=self.clipped_low / tokens,
            clip_fraction_by_pass=[
                clipped / max(count, 1.0) for clipped, count in zip(self.clipped_by_pass, self.tokens_by_pass)
            ],
            ratio_deviation_by_pass=self.deviation_by_pass,
            entropy=self.entropy_sum / max(self.entropy_tokens, 1.0),
            logprob_mismatch=self.mismatch_sum / self.mismatch_tokens if measured else None,
            logprob_mismatch_max=self.mismatch_max if measured else None,
            corrected_fraction=self.corrected_tokens / self.mismatch_tokens if measured else None,
            grad_norm=grad_norm,
            tokens=loss_tokens,
            skipped_steps=skipped,
            entropy_kept_fraction=self.entropy_kept / tokens if self.entropy_masked else None,
        )


def shared_prompt_pass_group(share_prompt_pass: bool, micro_batch_size: int, group_size: int, distributed: bool) -> int:
    """G where one prompt pass serves each group of G completions (trainer.share_prompt_pass and
    micro-batches of whole groups), else 1. Not under torchrun: DDP and FSDP expect one forward
    per backward. The memory planner plans by the same rule.

    Example: (True, 16, 8, False) -> 8;  (True, 4, 8, False) -> 1;  (True, 16, 8, True) -> 1
    """
    whole_groups = micro_batch_size % group_size == 0
    return group_size if share_prompt_pass and whole_groups and not distributed else 1


def update_policy(
    models: Models,
    rollout: Rollout,
    advantages: Advantages,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    trainer: TrainerConfig,
    max_grad_norm: float,
    beta: float,
    world: World = ONE_PROCESS,
) -> UpdateStats:
    """Train on one generation batch (this rank's share of it, under torchrun); `beta` is the KL
    coefficient in force this step."""
    device, policy = models.device, models.policy
    trained = models.ddp or policy  # the loss goes through DDP's wrapper when there is one: it syncs gradients
    micro = trainer.micro_batch_size or rollout.completion_ids.shape[0]  # whole groups under micro_batch_tokens
    group = shared_prompt_pass_group(trainer.share_prompt_pass, micro, rollout.group_size, world.enabled)
    batches, denominators = micro_batches(rollout, advantages, trainer, device, world, group)
    if denominators.tokens == 0:  # every completion left out (mask_truncated): nothing to learn from
        return UpdateStats.nothing_trained(trainer.num_iterations)
    settings = loss_settings(trainer, beta)
    rank_scale = world.world_size  # DDP / FSDP average the ranks' gradients; the shares must add up

    def log_probs_of(model, batch: MicroBatch, with_entropy=False):  # the policy, its DDP wrapper, or the reference
        here = next(model.parameters()).device  # a full fine-tune's reference may sit on the CPU
        ids = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.mask)
        with models.autocast():  # the forward only: the backward runs in the dtypes it chose
            log_probs, entropy = completion_log_probs(
                model, *(tensor.to(here) for tensor in ids), rollout.temperature, with_entropy, batch.prompt_pass_group
            )
        return log_probs.to(device), entropy

    policy.train()
    parameters = trainable_parameters(policy)
    totals, grad_norm, skipped = StepTotals(entropy_masked=settings.top_entropy_quantile < 1.0), 0.0, 0
    # float32 linears by oneDNN where that GEMM is the CPU's fastest; forward and backward both
    with OneDnnLinears(policy, models.reference):
        reference, old = frozen_log_probs(models, batches, log_probs_of, trainer.num_iterations > 1)
        for iteration in range(trainer.num_iterations):  # the paper's mu passes over the same rollout
            optimizer.zero_grad(set_to_none=True)  # nothing to free after a finished pass; a cut-off one
            totals.start_pass()
            for index, batch in enumerate(batches):
                last_batch = index == len(batches) - 1
                # DDP: gradients are exchanged once per pass, after the last micro-batch.
                syncing = contextlib.nullcontext() if last_batch or trained is policy else trained.no_sync()
                with syncing:
                    # the entropy: the first pass's metric, and every pass's for the entropy controls
                    log_probs, entropy = log_probs_of(trained, batch, iteration == 0 or settings.uses_entropy)
                    old_log_probs = old[index] if old is not None else log_probs.detach()
                    correction = sampler_correction(old_log_probs, batch, trainer)
                    losses = (log_probs, old_log_probs, reference[index], batch.advantages, batch.loss_mask)
                    weights = None if correction is None else correction.weights  # [n, t] w
                    loss, metrics = grpo_loss(*losses, settings, denominators, weights, entropy)
                    (loss * rank_scale).backward()
                if iteration == 0:  # the entropy metric: over every token of the policy's, truncated or not
                    own = batch.policy_tokens
                    totals.add_entropy((entropy.detach() * own).sum().item(), float(own.sum()))
                if iteration == 0 and correction is not None:  # the sampler's log-probs against the trainer's
                    totals.add_mismatch(old_log_probs, batch, correction)
                totals.add(loss.item(), metrics)
            grad_norm = clip_and_step(parameters, optimizer, scheduler, max_grad_norm)
            skipped += not math.isfinite(grad_norm)
    return totals.over_ranks(world).stats(grad_norm, denominators.tokens, skipped)


def sampler_correction(
    old_log_probs: torch.Tensor, batch: MicroBatch, trainer: TrainerConfig
) -> RolloutCorrection | None:
    """The rollout correction of `batch` (RolloutCorrection), or None where its sampler keeps no
    log-probs. old_log_probs: the trainer's at the weights that sampled ([n, t], no grad)."""
    if batch.sampler_log_probs is None:
        return None
    return rollout_weights(
        old_log_probs,
        batch.sampler_log_probs,
        batch.loss_mask,
        trainer.rollout_correction,
        trainer.rollout_correction_cap,
    )


def loss_settings(trainer: TrainerConfig, beta: float) -> LossSettings:
    return LossSettings(
        clip_eps=trainer.clip_eps,
        clip_eps_high=trainer.clip_eps if trainer.clip_eps_high is None else trainer.clip_eps_high,
        beta=beta,
        kl_estimator=trainer.kl_estimator,
        aggregation=trainer.loss_aggregation,
        kl_importance_correction=trainer.kl_importance_correction,
        loss=trainer.loss,
        importance_sampling_level=trainer.importance_sampling_level,
        delta=trainer.delta,
        dual_clip=trainer.dual_clip,
        cispo_ratio_min=trainer.cispo_ratio_min,
        cispo_ratio_max=trainer.cispo_ratio_max,
        sapo_temperature_pos=trainer.sapo_temperature_pos,
        sapo_temperature_neg=trainer.sapo_temperature_neg,
        entropy_coef=trainer.entropy_coef,
        top_entropy_quantile=trainer.top_entropy_quantile,
    )


def frozen_log_probs(models: Models, batches: list[MicroBatch], log_probs_of, with_old: bool):
    """Per micro-batch, without gradients: the reference's log-probs (None without a KL term),
    and the old policy's when mu > 1 (else None: the old policy is the current one, detached)."""
    with torch.no_grad():
        reference = [None] * len(batches)
        if models.uses_kl:
            with reference_model(models) as ref:
                reference = [log_probs_of(ref, batch)[0] for batch in batches]
        old = [log_probs_of(models.policy, batch)[0] for batch in batches] if with_old else None
    return reference, old


def clip_and_step(
    parameters: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    max_grad_norm: float,
) -> float:
    """Clip the gradients and step, unless their norm is not finite (the step is skipped); then
    free them. Returns the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm or math.inf)
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP: a DTensor
    if math.isfinite(grad_norm):
        optimizer.step()
        scheduler.step()
    # Free the gradients now rather than at the next update: kept, they would sit through the
    # next step's sampling, the peak of many runs (the memory planner counts them in the update).
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def micro_batches(
    rollout: Rollout,
    advantages: Advantages,
    trainer: TrainerConfig,
    device: torch.device,
    world: World,
    prompt_pass_group: int = 1,
) -> tuple[list[MicroBatch], LossDenominators]:
    """The rollout cut into micro-batches on `device`, of trainer.micro_batch_size rows (all at
    once for 0) or by trainer.micro_batch_tokens (token_budget_rows; `prompt_pass_group` G where
    one prompt pass serves each group), with the loss mask (less truncated completions under
    trainer.mask_truncated), and the loss denominators of the whole step, over all ranks: each
    rank's loss is then its share of the step's loss."""
    prompt_ids, prompt_mask = rollout.prompt_ids.to(device), rollout.prompt_mask.to(device)
    completion_ids, mask = rollout.completion_ids.to(device), rollout.completion_mask.to(device)
    loss_mask = rollout.trained_mask.to(device)  # multi-turn: the tool's and template's tokens left out
    if trainer.mask_truncated:  # DAPO's overlong filter: no credit or blame for a cut-off answer
        loss_mask = loss_mask * (~rollout.truncated).to(device).unsqueeze(1).to(loss_mask.dtype)
    advantage_values = advantages.values.to(device)
    sampler_log_probs = None if rollout.sampler_log_probs is None else rollout.sampler_log_probs.to(device)
    count = completion_ids.shape[0]
    size = trainer.micro_batch_size or count
    cuts: list[tuple[slice | torch.Tensor, int]] = [
        (slice(start, start + size), prompt_pass_group) for start in range(0, count, size)
    ]
    if trainer.micro_batch_tokens > 0:
        lengths = (prompt_mask.sum(dim=1).cpu(), mask.sum(dim=1).cpu())
        cuts = token_budget_rows(*lengths, prompt_pass_group, trainer.micro_batch_tokens)
    tensors = (prompt_ids, prompt_mask, completion_ids, mask, loss_mask, advantage_values, sampler_log_probs)
    policy_mask = None if rollout.policy_mask is None else rollout.policy_mask.to(device)
    batches = [micro_batch(rows, *tensors, group, policy_mask) for rows, group in cuts]
    # The sampler pads every completion to max_new_tokens, so T is Dr. GRPO's constant.
    sequences, tokens = sum_over_ranks([count, float(loss_mask.sum())], world)
    return batches, LossDenominators(
        sequences=int(sequences), tokens=int(tokens), max_new_tokens=completion_ids.shape[1]
    )


def token_budget_rows(
    prompt_lengths: torch.Tensor,  # [N] real prompt tokens of each row
    completion_lengths: torch.Tensor,  # [N] completion tokens up to and including EOS
    group_size: int,
    budget: int,
) -> list[tuple[torch.Tensor, int]]:
    """(row indices, prompt_pass_group) of each micro-batch under `budget` tokens a forward, counted on
    the rectangle micro_batch cuts out: rows x the longest completion, plus the longest prompt
    once per group where one prompt pass serves each group of `group_size` rows (1: once per
    row). Whole groups, longest first, fill a micro-batch while it stays within the budget; a
    group over the budget on its own is split into its rows, which fill micro-batches of their
    own the same way (mixed with whole groups they would cost the groups their shared pass); a
    row over the budget runs alone. Sorting by length keeps each rectangle's padding small, as
    verl's dynamic batch size does by balancing lengths.

    Example: prompts of 10 tokens, completions [50, 5, 40, 5] by row, group_size 2, budget 130:
    group (0, 1) costs 10 + 2 x 50 = 110, group (2, 3) 10 + 2 x 40 = 90, both together
    2 x 10 + 4 x 50 = 220: two micro-batches, rows [0, 1] and [2, 3], each with its shared
    prompt pass (group 2). Budget 100: group (2, 3) still fits; group (0, 1) does not, and its
    rows, 60 and 15 tokens apart, 2 x (10 + 50) = 120 together, run one by one (group 1).
    """
    rows = prompt_lengths.shape[0]
    width = completion_lengths.clamp(min=1)  # micro_batch keeps at least one completion column
    if rows % group_size:  # not a rollout's layout: every row on its own
        group_size = 1

    def cost(members: list[int], prompt_passes: int) -> int:
        return int(prompt_lengths[members].max()) * prompt_passes + int(width[members].max()) * len(members)

    groups = [list(range(start, start + group_size)) for start in range(0, rows, group_size)]
    whole = [group for group in groups if cost(group, 1) <= budget]
    split = [[row] for group in groups if cost(group, 1) > budget for row in group]
    shared = group_size > 1  # whole groups: one prompt pass each; single rows: one pass per row
    batches = [
        (members, group_size)
        for members in _fill(whole, budget, lambda members, pieces: cost(members, pieces if shared else len(members)))
    ]
    batches += [(members, 1) for members in _fill(split, budget, lambda members, pieces: cost(members, len(members)))]
    return [(torch.tensor(members, dtype=torch.long), group) for members, group in batches]


def _fill(pieces: list[list[int]], budget: int, cost) -> list[list[int]]:
    """Pieces (lists of rows) sorted by their cost alone, longest first, packed in turn into
    micro-batches while cost(rows, pieces in it) stays within `budget`."""
    pieces = sorted(pieces, key=lambda piece: -cost(piece, 1))
    batches: list[list[int]] = []
    current: list[int] = []
    count = 0
    for piece in pieces:
        if current and cost(current + piece, count + 1) > budget:
            batches.append(current)
            current, count = [], 0
        current, count = current + piece, count + 1
    return batches + [current] if current else batches
