"""The training loop, top to bottom: prompts -> sample -> reward -> advantage -> update -> log
-> checkpoint. Every stage is a module of its own; this file only calls them in order.

`run(cfg)` takes a composed config (Hydra's, or OmegaConf.structured(Config) in code) whose
`trainer.output_dir` is set, and returns the run's result for callers and tests.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Optional

import torch
from omegaconf import OmegaConf

from grpo_cli.algorithm.advantages import group_advantages
from grpo_cli.algorithm.optim import make_optimizer, make_scheduler
from grpo_cli.algorithm.update import update_policy
from grpo_cli.checkpoint import latest_checkpoint
from grpo_cli.config import BetaSchedule, ConfigError, advantage_mode, beta_schedule, boosted_group_size
from grpo_cli.console import sample_entries
from grpo_cli.data.prompts import PromptSource, train_and_eval_rows
from grpo_cli.distributed import (
    ONE_PROCESS,
    World,
    broadcast_from_main,
    is_sharded,
    join_process_group,
    leave_process_group,
    max_over_ranks,
    rank_device,
    reduce_metrics,
    sampling_seed,
    weights_spread,
    wrap_for_training,
)
from grpo_cli.evaluation import evaluate
from grpo_cli.logs import QuietLogger, RunLogger, resident_memory_gb
from grpo_cli.metrics import step_metrics
from grpo_cli.models.loading import Models, load_models, refresh_reference, resolve_device, trainable_parameters
from grpo_cli.planner.check import check_memory, print_plan
from grpo_cli.records import Advantages, Rewards, Rollout
from grpo_cli.rewards.api import RewardScorer
from grpo_cli.run_lock import hold_run_folder
from grpo_cli.run_summary import summarize_run
from grpo_cli.safety.adaptive import AdaptiveGroupState, next_group_size
from grpo_cli.safety.dynamic import fill_informative_groups
from grpo_cli.safety.guard import roll_back, rollback_reason
from grpo_cli.sampling import Sampler, run_sampler
from grpo_cli.state import TrainState, find_resume_checkpoint, seed_everything
from grpo_cli.stopping import StopRequests
from grpo_cli.validation import validate


@dataclass
class RunResult:
    output_dir: Path
    steps_done: int
    eval_before: Optional[float]
    eval_after: Optional[float]
    last_checkpoint: Optional[Path]


@dataclass
class RunParts:
    """What every step works with, loaded once by `run`."""

    cfg: Any
    models: Models
    sampler: Sampler
    scorer: RewardScorer
    prompts: PromptSource
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    betas: BetaSchedule
    world: World = ONE_PROCESS  # this process's rank under torchrun
    eval_scorer: Optional[RewardScorer] = None  # eval.functions' scorer; None: the training rewards


@dataclass
class StepResult:
    metrics: dict[str, Any]  # one metrics.jsonl row (without "step")
    rollout: Rollout  # what was trained on: B x G completions
    rewards: Rewards  # [B, G]
    advantages: Advantages  # [B*G]
    beta: float  # the KL coefficient in force


def run(cfg: Any) -> Optional[RunResult]:
    if cfg.trainer.plan:  # the memory plan alone: nothing is loaded, the model need not be here
        validate(cfg, check_files=False)
        print_plan(cfg)
        return None
    validate(cfg)
    world = join_process_group(cfg.trainer.distributed)  # ONE_PROCESS unless started by torchrun
    folder = cfg.trainer.output_dir  # rank 0's: the one it writes to (train raises when it is unset)
    try:
        with hold_run_folder(Path(folder)) if folder and world.is_main else contextlib.nullcontext():
            return train(cfg, world)
    finally:
        leave_process_group()


def train(cfg: Any, world: World) -> RunResult:
    trainer = cfg.trainer
    output_dir = run_folder(trainer, world)
    resume_from = find_resume_checkpoint(trainer.resume, output_dir, report=print if world.is_main else ignore)
    scorer = RewardScorer.from_config(
        cfg.reward, trainer.std_eps, cfg.sampler.max_new_tokens
    )  # imports each _target_: fails before loading
    eval_scorer = scorer.for_eval(cfg)
    seed_everything(trainer.seed)
    device = resolve_device(rank_device(trainer.device, world))
    train_rows, eval_rows = train_and_eval_rows(cfg.data)
    check_memory(cfg, device, train_rows + eval_rows, output_dir, world)  # stops here if it will not fit
    parts = load_parts(cfg, scorer, train_rows, device, world, resume_from, eval_rows)
    parts.eval_scorer = eval_scorer
    if world.is_main:
        print(parts.models.precision, flush=True)
    with contextlib.closing(parts.sampler):  # sampler=vllm: the engine goes at any end
        return train_parts(cfg, parts, eval_rows, output_dir, resume_from, world)


def train_parts(
    cfg: Any,
    parts: RunParts,
    eval_rows: list[dict[str, Any]],
    output_dir: Path,
    resume_from: Optional[Path],
    world: World,
) -> RunResult:
    """The run's steps with its parts loaded, from its first step or `resume_from`'s next."""
    trainer = cfg.trainer
    state = TrainState(
        parts.models.policy,
        parts.optimizer,
        parts.scheduler,
        parts.prompts,
        AdaptiveGroupState.from_state_dict(None, cfg.sampler.group_size),
        world=world,
        reference=parts.models.reference if trainer.ref_sync_steps else None,  # saved and resumed when it moves
    )
    if resume_from is not None:
        state.resume(resume_from)
    log = open_log(cfg, output_dir, state.step, world)
    if resume_from is not None:
        log.print(f"Resuming from {resume_from} (step {state.step}).")
    started, start_step = time.perf_counter(), state.step
    eval_before = evaluate_before(parts, eval_rows, log) if eval_rows and start_step == 0 else None
    last_checkpoint, eval_after, step = None, None, start_step
    with StopRequests() as stop:
        try:
            for step in range(start_step + 1, trainer.steps + 1):
                result = train_step(parts, step, state.adaptive.group_size, state.guard.beta_scale)
                state.step, metrics, final = step, result.metrics, step == trainer.steps
                if step == start_step + 1:  # a misspelt metric would rank no checkpoint: say it now
                    check_best_metric(trainer.best_metric, metrics, eval_keys(parts, eval_rows))
                if trainer.ref_sync_steps and step % trainer.ref_sync_steps == 0:  # TR-DPO's soft update
                    refresh_reference(parts.models, trainer.ref_mixup_alpha)
                    metrics["ref/refreshed"] = 1.0
                if cfg.sampler.adaptive.enabled:
                    adapt_group_size(cfg.sampler, state.adaptive, step, metrics, log)
                if eval_rows and (final or (trainer.eval_every and step % trainer.eval_every == 0)):
                    metrics.update(evaluate_policy(parts, eval_rows))
                    eval_after = metrics["eval/accuracy"]
                if trainer.guard.enabled:  # before the checkpoint: a bad step is never saved as good
                    guard_step(trainer.guard, state, metrics, output_dir, log)
                log_step(log, trainer, step, result)
                stopping = stop_requested(stop, world)
                if final or (trainer.checkpoint_every and step % trainer.checkpoint_every == 0) or stopping:
                    meta = {
                        "reward_mean": metrics["reward/mean"],
                        "kl": metrics["kl"],
                        "beta": result.beta,
                        "best_metric": trainer.best_metric,  # what keep_best and grpo-export --best rank by
                        "best_metric_mode": trainer.best_metric_mode,
                        "best_value": metrics.get(trainer.best_metric),
                    }
                    last_checkpoint = state.save(
                        output_dir, parts.models.tokenizer, meta, trainer.keep_last, trainer.keep_best
                    )
                if stopping:  # SIGINT / SIGTERM: the finished step is kept
                    log.print(
                        f"Stopped by {stopping} after step {step}; checkpoint {last_checkpoint}. "
                        f"Continue with the same command plus trainer.resume=true hydra.run.dir={output_dir}"
                    )
                    break
        except KeyboardInterrupt:  # a second Ctrl-C: stop now, the step in flight is lost
            interrupted(log, step, output_dir)
    log.close()
    result = RunResult(output_dir, state.step, eval_before, eval_after, last_checkpoint)
    summarize(log, result, state.step - start_step, time.perf_counter() - started, eval_scorer_of(parts).names[1:])
    return result


def eval_keys(parts: RunParts, eval_rows: list[dict[str, Any]]) -> list[str]:
    """The metric names the greedy eval logs (none without eval prompts)."""
    if not eval_rows:
        return []
    names = ["eval/accuracy", "eval/reward", *(f"eval/{name}" for name in eval_scorer_of(parts).names)]
    return names + (["eval/pass_at_k"] if parts.cfg.trainer.eval_pass_at_k else [])


def check_best_metric(name: str, step_metrics: dict[str, Any], eval_names: list[str]) -> None:
    """ConfigError unless trainer.best_metric is one of the metrics this run logs."""
    logged = sorted({*step_metrics, *eval_names})
    if name not in logged:
        raise ConfigError(
            f"trainer.best_metric={name} is not a metric this run logs, so no checkpoint could be "
            f"ranked by it. The run's metrics: {', '.join(logged)}. Set trainer.best_metric to one "
            "of them (reward/mean by default, eval/accuracy for the greedy eval); the run stopped "
            "after its first step, before saving it."
        )


def interrupted(log: RunLogger | QuietLogger, step: int, output_dir: Path) -> NoReturn:
    """A second Ctrl-C: exit 130 at once, saying which checkpoint a resume would continue from."""
    log.close()
    newest = latest_checkpoint(output_dir)
    log.print(
        f"Interrupted during step {step}; newest complete checkpoint: {newest or 'none'}. "
        f"Continue with trainer.resume=true hydra.run.dir={output_dir}"
    )
    raise SystemExit(130) from None


def run_folder(trainer: Any, world: World) -> Path:
    """trainer.output_dir, created; under torchrun rank 0's name (ranks may have named it at
    different seconds)."""
    if not trainer.output_dir:
        raise ConfigError("trainer.output_dir is not set: give the folder the run writes to.")
    output_dir = Path(broadcast_from_main(trainer.output_dir, world))
    output_dir.mkdir(parents=True, exist_ok=True)
    return output_dir


def open_log(cfg: Any, output_dir: Path, start_step: int, world: World) -> RunLogger | QuietLogger:
    """Rank 0 saves the resolved config and logs (console, metrics.jsonl, backends); the others
    stay quiet."""
    if not world.is_main:
        return QuietLogger()
    OmegaConf.save(cfg, output_dir / "config.yaml", resolve=True)
    return RunLogger(
        output_dir,
        cfg.trainer.steps,
        start_step,
        cfg.trainer.log_every,
        cfg.logger,
        OmegaConf.to_container(cfg, resolve=True),
    )


def evaluate_before(parts: RunParts, eval_rows: list[dict[str, Any]], log: RunLogger | QuietLogger) -> float:
    """The greedy eval of the untrained policy: row 0 of metrics.jsonl, where every curve starts."""
    before = evaluate_policy(parts, eval_rows)
    log.print(f"Greedy eval before training: accuracy {before['eval/accuracy']:.3f} on {len(eval_rows)} prompts")
    log.log_step(0, before)
    return before["eval/accuracy"]


def eval_scorer_of(parts: RunParts) -> RewardScorer:
    return parts.eval_scorer if parts.eval_scorer is not None else parts.scorer


def evaluate_policy(parts: RunParts, eval_rows: list[dict[str, Any]]) -> dict[str, float]:
    trainer = parts.cfg.trainer
    return evaluate(
        parts.models.policy,
        parts.sampler,
        eval_scorer_of(parts),
        parts.prompts,
        eval_rows,
        seed=trainer.seed,
        pass_at_k=trainer.eval_pass_at_k,
    )


def adapt_group_size(
    sampler: Any, adaptive: AdaptiveGroupState, step: int, metrics: dict[str, Any], log: RunLogger | QuietLogger
) -> None:
    """sampler.adaptive: this step's rewards set the group size of the next one."""
    change = next_group_size(
        sampler.adaptive,
        adaptive,
        boosted_group_size(sampler),
        step,
        metrics["reward/mean"],
        metrics["advantage/zero_std_fraction"],
    )
    if change is not None:
        log.print(f"[cyan]step {step}: {change}")


def guard_step(
    guard: Any, state: TrainState, metrics: dict[str, Any], output_dir: Path, log: RunLogger | QuietLogger
) -> None:
    """trainer.guard: roll back to the last good checkpoint when this step's metrics call for it."""
    reason = rollback_reason(guard, state.guard, state.step, metrics)
    if reason is not None:
        target = roll_back(
            guard, state.guard, state.step, reason, output_dir, state.restore_weights, state.optimizer, state.scheduler
        )
        log.print(
            f"[yellow]guard: {reason}; rolled back to {target}, beta now "
            f"x{state.guard.beta_scale:g}, learning rate x{state.guard.lr_scale:g}"
        )
    metrics["guard/rollbacks"] = len(state.guard.rollbacks)


def log_step(log: RunLogger | QuietLogger, trainer: Any, step: int, result: StepResult) -> None:
    """The step's metrics row, the reward functions that failed, and every `sample_every` steps
    a table of samples."""
    for name, why in result.rewards.errors.items():
        count = result.rewards.error_counts.get(name, 0)
        log.print(
            f"[yellow]step {step}: reward function {name} failed on {count} completions "
            f"(first: {why}); those scored None"
        )
    log.log_step(step, result.metrics)
    if trainer.sample_every and step % trainer.sample_every == 0:
        log.log_samples(sample_entries(step, result.rollout, result.rewards, result.advantages, trainer.sample_prompts))


def stop_requested(stop: StopRequests, world: World) -> Optional[str]:
    """Why the run stops after this step (a SIGINT or SIGTERM), or None. A signal may reach one
    rank first: the ranks agree, so all stop after the same step."""
    if world.enabled:
        stopping = max_over_ranks([float(stop.requested is not None)], world)[0]
        stop.requested = stop.requested or ("a signal to another process" if stopping else None)
    return stop.requested


def load_parts(
    cfg: Any,
    scorer: RewardScorer,
    train_rows: list[dict[str, Any]],
    device: torch.device,
    world: World = ONE_PROCESS,
    resume_from: Optional[Path] = None,
    eval_rows: Sequence[dict[str, Any]] = (),
) -> RunParts:
    """Models (the policy from `resume_from` when given), prompts, optimizer, scheduler and
    sampler: what `train_step` works with (scripts/bench_step.py builds them the same way).
    sampler=vllm sizes its engine to the longest prompt of train_rows and eval_rows."""
    betas = beta_schedule(cfg.trainer.beta)
    models = load_models(cfg.model, betas.peak, device, checkpoint=str(resume_from) if resume_from else None)
    models = wrap_for_training(models, world)
    prompts = PromptSource(cfg.data, models.tokenizer, train_rows, world)
    optimizer = make_optimizer(cfg.optimizer, trainable_parameters(models.policy))
    scheduler = make_scheduler(cfg.optimizer, optimizer, cfg.trainer.steps * cfg.trainer.num_iterations)
    sampler = run_sampler(cfg, models, [*train_rows, *eval_rows], synced=is_sharded(world))
    return RunParts(cfg, models, sampler, scorer, prompts, optimizer, scheduler, betas, world)


def train_step(parts: RunParts, step: int, group_size: int, beta_scale: float) -> StepResult:
    """One GRPO step: sample B x G completions, score them, normalize rewards within each group,
    update the policy (PPO-clip + KL), and measure it all.

    `group_size` is G for this step (adaptive group size may raise it); `beta_scale` multiplies
    the scheduled beta (the guard raises it after a rollback).
    """
    cfg, trainer = parts.cfg, parts.cfg.trainer
    # Sampling randomness is a function of (seed, step) alone, so a resumed run draws exactly
    # what an unbroken one would have.
    torch.manual_seed(sampling_seed(trainer.seed, step, parts.world.rank))
    step_started = time.perf_counter()
    cost = SamplingCost()

    def sample_round() -> tuple[Rollout, Rewards]:
        return sample_and_score(parts, group_size, cost)

    rollout, rewards = sample_round()
    filled = None
    if trainer.filter_zero_std:  # DAPO dynamic sampling: only groups whose rewards differ
        filled = fill_informative_groups(
            rollout, rewards, sample_round, rollout.num_prompts, trainer.max_resample_rounds, trainer.std_threshold
        )
        rollout, rewards = filled.rollout, filled.rewards
    scored = time.perf_counter()
    mode = advantage_mode(cfg)
    advantages = group_advantages(rewards.for_advantages, trainer.std_eps, trainer.std_threshold, mode)
    beta = parts.betas.at(step - 1) * beta_scale
    stats = update_policy(
        parts.models,
        rollout,
        advantages,
        parts.optimizer,
        parts.scheduler,
        trainer,
        cfg.optimizer.max_grad_norm,
        beta,
        parts.world,
    )
    updated = time.perf_counter()

    metrics = step_metrics(rollout, rewards, advantages, stats, beta, parts.scheduler.get_last_lr()[0])
    metrics |= filled.metrics() if filled is not None else {}
    metrics |= cost.metrics() | {
        "sampler/group_size": group_size,
        "time/update": updated - scored,
        "time/step": updated - step_started,
        "memory/rss_gb": resident_memory_gb(),
    }
    if parts.world.enabled:  # one row for the whole step; and (DDP) proof the ranks hold the same weights
        metrics = reduce_metrics(metrics, parts.world)
        if not is_sharded(parts.world):
            metrics["distributed/weights_spread"] = weights_spread(
                trainable_parameters(parts.models.policy), parts.world
            )
    return StepResult(metrics, rollout, rewards, advantages, beta)


@dataclass
class SamplingCost:
    """What a step's sampling rounds (one, or more with dynamic sampling) took, added up."""

    sample_seconds: float = 0.0
    reward_seconds: float = 0.0
    tokens: int = 0  # completion tokens generated

    def metrics(self) -> dict[str, float]:
        return {
            "time/sample": self.sample_seconds,
            "time/reward": self.reward_seconds,
            "tokens_per_second": self.tokens / max(self.sample_seconds, 1e-9),  # all rounds
        }


def sample_and_score(parts: RunParts, group_size: int, cost: SamplingCost) -> tuple[Rollout, Rewards]:
    """The next batch of prompts -> its B x G completions and their rewards; adds the seconds
    spent and the tokens generated to `cost` (a step may sample several rounds)."""
    started = time.perf_counter()
    rollout = parts.sampler.sample(parts.models.policy, parts.prompts.next_batch(), group_size)
    sampled = time.perf_counter()
    rewards = parts.scorer.score(rollout)
    cost.sample_seconds += sampled - started
    cost.reward_seconds += time.perf_counter() - sampled
    cost.tokens += int(rollout.completion_mask.sum())
    return rollout, rewards


def ignore(_: str) -> None:
    """A report that goes nowhere (ranks other than 0)."""


def summarize(log: RunLogger, result: RunResult, steps: int, seconds: float, other_functions: list[str]) -> None:
    """The closing table: `steps` done in this invocation in `seconds`; `other_functions` are the
    reward functions after the first, whose greedy evals are shown before -> after too."""
    eval_before, eval_after = result.eval_before, result.eval_after
    summary = summarize_run(log.history)  # the numbers grpo-report gives
    first, last, window = summary.reward_first, summary.reward_last, summary.window
    rows = {
        "steps this run": str(steps),
        "time": f"{seconds:.1f} s ({seconds / max(steps, 1):.2f} s/step)",
    }
    if first is not None and last is not None:
        rows[f"sampled reward, first vs last {window} steps"] = f"{first:.3f} -> {last:.3f}"
    if eval_before is not None or eval_after is not None:
        before = "-" if eval_before is None else f"{eval_before:.3f}"
        after = "-" if eval_after is None else f"{eval_after:.3f}"
        rows["greedy eval accuracy, before -> after"] = f"{before} -> {after}"
    evals = [row for row in log.history if "eval/accuracy" in row]
    # e.g. a format share or a lenient reading beside the accuracy; a multi-turn run's tool use
    for name in [*other_functions, "tool_use", "turns"]:
        key = f"eval/{name}"
        if len(evals) >= 2 and key in evals[0] and key in evals[-1]:
            rows[f"greedy eval {name}, before -> after"] = f"{evals[0][key]:.3f} -> {evals[-1][key]:.3f}"
    rows["run folder"] = str(result.output_dir)
    rows["last checkpoint"] = str(result.last_checkpoint) if result.last_checkpoint else "none"
    log.summary(rows)
