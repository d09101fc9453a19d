"""Before any weight is loaded: the run's memory plan (memory.py), printed and saved beside the
run, and the stop when the plan's peak exceeds the budget.

The budget is `trainer.memory_budget_gb` when set, else what this process can have now: the
free memory of its GPU (torch.cuda.mem_get_info), or the machine's available RAM (psutil)
shared by the processes torchrun started on it. `trainer.plan_force=true` trains anyway;
`trainer.plan=true` prints the plan and stops (pipeline.run), on any machine: a model that is
not here is counted from its preset's `model.architecture`.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch

from grpo_cli.config import ConfigError
from grpo_cli.distributed import ONE_PROCESS, World, max_over_ranks
from grpo_cli.planner.memory import GB, MemoryPlan, cheapest_fixes, format_fixes, format_plan, plan_memory

PLAN_FILE = "memory_plan.txt"


class Budget(NamedTuple):
    bytes: int  # what the plan's peak must fit in
    source: str  # where the number comes from, for the messages


def memory_budget(trainer: Any, device: torch.device) -> Optional[Budget]:
    """The budget of a process on `device`; None when `device` is a GPU this machine lacks."""
    if trainer.memory_budget_gb is not None:
        return Budget(int(trainer.memory_budget_gb * GB), f"trainer.memory_budget_gb={trainer.memory_budget_gb}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _ = torch.cuda.mem_get_info(device)
        return Budget(free, f"free memory of {device}")
    import psutil

    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's processes on this machine
    shared = f", shared by {processes} processes" if processes > 1 else ""
    return Budget(psutil.virtual_memory().available // processes, f"available RAM{shared}")


def rank_share(cfg: Any, world: World) -> Any:
    """`cfg` with this rank's share of the step's prompts, as the rank trains them."""
    share = copy.deepcopy(cfg)
    share.data.prompts_per_step = max(1, cfg.data.prompts_per_step // world.world_size)
    return share


def plan_for(
    cfg: Any, device: torch.device, prompt_rows: Optional[list[dict[str, Any]]], world: World = ONE_PROCESS
) -> MemoryPlan:
    """The plan of this process: its share of the step's prompts, the prompts padded to the
    longest of `prompt_rows` when the tokenizer is on this machine (else memory.py's guess)."""
    share = rank_share(cfg, world)
    plan = plan_memory(share, _longest_prompt(cfg, prompt_rows), device.type)
    if world.world_size > 1:
        plan.assumptions.append(f"this rank's {share.data.prompts_per_step} of {cfg.data.prompts_per_step} prompts")
        if world.mode == "fsdp":
            plan.assumptions.append(
                "held rows are whole copies: FSDP keeps 1/N of them on each rank, so the plan overstates them"
            )
    return plan


def _longest_prompt(cfg: Any, rows: Optional[list[dict[str, Any]]]) -> Optional[int]:
    from grpo_cli.data.prompts import prompt_lengths
    from grpo_cli.models.loading import local_tokenizer_and_context
    from grpo_cli.multiturn.conversation import tools_prompt_tokens

    local = local_tokenizer_and_context(cfg.model) if rows else None
    if local is None:
        return None
    rollout = cfg.get("rollout")
    # Without a chat template there are no tools to describe (MultiTurnSampler refuses the run).
    tools = rollout is not None and rollout.tools and getattr(local[0], "chat_template", None)
    told = tools_prompt_tokens(rollout.tools, local[0]) if tools else 0
    return max(prompt_lengths(cfg.data, rows, local[0])) + told


def check_memory(
    cfg: Any, device: torch.device, prompt_rows: list[dict[str, Any]], output_dir: Path, world: World = ONE_PROCESS
) -> None:
    """Print and save the plan (rank 0), then raise ConfigError on every rank if the plan does
    not fit some rank's budget, unless trainer.plan_force. A model the planner cannot count
    (not a Qwen2/Llama-style decoder) is said so and trained without a plan."""
    try:
        plan = plan_for(cfg, device, prompt_rows, world)
    except ConfigError as error:
        if world.is_main:
            print(f"Memory plan: not made ({error})", flush=True)
        return
    budget = memory_budget(cfg.trainer, device)
    table = format_plan(plan, budget.bytes if budget else None)
    if world.is_main:
        print(table, flush=True)
        (output_dir / PLAN_FILE).write_text(table + "\n")
    over = budget is not None and plan.peak_bytes > budget.bytes
    if not max_over_ranks([float(over)], world)[0] or cfg.trainer.plan_force:
        return
    if not over:  # another rank's budget is the one exceeded; it names the fixes
        raise ConfigError("the memory plan does not fit on another rank (see its message); nothing was loaded.")
    raise ConfigError(
        not_fitting_message(rank_share(cfg, world), plan, budget, "the run stopped before loading any weight")
    )


def not_fitting_message(cfg: Any, plan: MemoryPlan, budget: Budget, consequence: str) -> str:
    fixes = cheapest_fixes(cfg, plan, budget.bytes)
    ranked = format_fixes(fixes, budget.bytes) or "(none of the planner's fixes lowers this peak)"
    return (
        f"the memory plan above peaks at {plan.peak_bytes / GB:.2f} GB ({plan.peak_phase}), more than "
        f"the {budget.bytes / GB:.2f} GB budget ({budget.source}), so {consequence}. The cheapest "
        "changes, each with the peak it gives together with those above it:\n"
        f"{ranked}\nApply them as overrides, or set trainer.plan_force=true to train anyway "
        "(the plan is an estimate: docs/MEMORY.md says how close it comes)."
    )


def print_plan(cfg: Any) -> None:
    """`trainer.plan=true`: the plan of this config on trainer.device (auto: a GPU if this
    machine has one), its verdict against the budget when there is one, and the fixes."""
    from grpo_cli.data.prompts import train_and_eval_rows
    from grpo_cli.models.loading import resolve_device

    try:
        rows = train_and_eval_rows(cfg.data)[0]
    except ConfigError:
        rows = None  # the data lives on another machine: prompt lengths are guessed
    setting = str(cfg.trainer.device).lower()
    device = torch.device(setting) if setting.startswith("cuda") else resolve_device(setting)
    plan = plan_for(cfg, device, rows)
    budget = memory_budget(cfg.trainer, device)
    print(format_plan(plan, budget.bytes if budget else None), flush=True)
    if budget is None:
        print(
            "No budget: this machine has no GPU; set trainer.memory_budget_gb=N to check the plan "
            "against a card's memory.",
            flush=True,
        )
    elif plan.peak_bytes > budget.bytes:
        print(not_fitting_message(cfg, plan, budget, "a run would stop before loading"), flush=True)
