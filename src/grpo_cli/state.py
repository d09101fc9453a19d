"""What a run must restore, in one record: `TrainState`.

A step changes the weights, the optimizer's moments, the scheduler's position, the data order's
position, the RNGs, and the guard's and the adaptive group size's counters. A checkpoint saves
all of it (`save`), `trainer.resume` loads all of it back (`resume`; the weights were already
loaded with the model), and the guard's rollback loads the weights and the optimizer of an
earlier checkpoint (`restore_weights`). One record serves the three, so a field added here is
saved, resumed and rolled back alike, and the rollback works wherever a checkpoint does (FSDP
included: the checkpoint's full tensors are sharded again as they load).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from grpo_cli.checkpoint import (
    CheckpointError,
    load_policy_weights,
    load_reference_weights,
    load_trainer_state,
    newest_resumable,
    non_finite_tensor,
    save_checkpoint,
    set_rng_state,
)
from grpo_cli.config import ConfigError, resume_mode
from grpo_cli.data.prompts import PromptSource
from grpo_cli.distributed import (
    ONE_PROCESS,
    World,
    barrier,
    broadcast_from_main,
    full_states,
    is_sharded,
    load_optimizer_state,
)
from grpo_cli.safety.adaptive import AdaptiveGroupState
from grpo_cli.safety.guard import GuardState


@dataclass
class TrainState:
    """The live objects a step changes (held, not copied) and the counters beside them."""

    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    prompts: PromptSource
    adaptive: AdaptiveGroupState
    guard: GuardState = field(default_factory=GuardState)
    step: int = 0  # the last step done
    world: World = ONE_PROCESS
    reference: Optional[torch.nn.Module] = None  # a reference that moves (trainer.ref_sync_steps), else None

    def state_dict(self) -> tuple[Optional[dict[str, Any]], dict[str, Any]]:
        """(the policy's full weights under FSDP else None, trainer_state.pt's contents without
        the RNGs, which save_checkpoint adds). A collective under FSDP: every rank calls it."""
        model_state, optimizer_state = full_states(self.policy, self.optimizer, self.world)
        return model_state, {
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "data": self.prompts.state_dict(),
            "guard": self.guard.state_dict(),
            "adaptive": self.adaptive.state_dict(),
        }

    def save(self, output_dir: Path, tokenizer: Any, meta: dict[str, Any], keep_last: int, keep_best: int) -> Path:
        """Checkpoint `self.step`: rank 0 writes, the others wait until it is complete; every
        rank gets its path."""
        model_state, trainer_state = self.state_dict()
        saved = (
            save_checkpoint(
                output_dir,
                self.step,
                self.policy,
                tokenizer,
                trainer_state,
                meta,
                keep_last=keep_last,
                keep_best=keep_best,
                model_state=model_state,
                reference=self.reference,
            )
            if self.world.is_main
            else None
        )
        barrier(self.world)
        return broadcast_from_main(saved, self.world)

    def resume(self, checkpoint: Path) -> None:
        """Continue from `checkpoint`, whose weights the policy was loaded from: the step, the
        optimizer, the schedule, the data position, the RNGs and the counters."""
        broken = non_finite_tensor(self.policy.state_dict())
        if broken is not None:
            raise CheckpointError(
                f"trainer.resume: {checkpoint} holds NaN or inf weights ({broken}); a run "
                "cannot continue from it. Resume from an earlier checkpoint (trainer.resume=PATH)."
            )
        state = load_trainer_state(checkpoint)
        load_optimizer_state(self.policy, self.optimizer, state["optimizer"], self.world)
        self.scheduler.load_state_dict(state["scheduler"])
        self.prompts.load_state_dict(state["data"])
        load_reference_weights(self.reference, checkpoint)
        set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.guard = GuardState.from_state_dict(state.get("guard"))
        self.adaptive = AdaptiveGroupState.from_state_dict(state.get("adaptive"), self.adaptive.base_group_size)

    def restore_weights(self, checkpoint: Path) -> None:
        """The guard's rollback: `checkpoint`'s weights and optimizer moments; the step, the data
        position and the RNGs go on. A collective under FSDP."""
        load_policy_weights(self.policy, checkpoint, sharded=is_sharded(self.world))
        load_reference_weights(self.reference, checkpoint)  # the reference as it was at that step
        load_optimizer_state(self.policy, self.optimizer, load_trainer_state(checkpoint)["optimizer"], self.world)


def find_resume_checkpoint(resume: Any, output_dir: Path, report: Callable[[str], None] = print) -> Optional[Path]:
    """The checkpoint trainer.resume names: with `true`, the newest one of the run that can be
    resumed, `report`ing each newer one passed over as damaged (cut off, overwritten)."""
    mode = resume_mode(resume)
    if mode is None:
        return None
    if mode != "latest":
        return Path(mode)  # validate has checked it
    found, skipped = newest_resumable(output_dir)
    if found is None and skipped:
        reasons = "; ".join(f"{path.name}: {why}" for path, why in skipped)
        raise ConfigError(
            f"trainer.resume=true, but no checkpoint in {output_dir}/checkpoints can be resumed "
            f"({reasons}). Start a fresh run (trainer.resume=false) in another folder."
        )
    if found is None:
        raise ConfigError(
            f"trainer.resume=true, but {output_dir}/checkpoints holds no complete checkpoint. "
            "Point the run at the old run's folder (hydra.run.dir=... or trainer.output_dir=...), "
            "or give a checkpoint folder: trainer.resume=PATH."
        )
    for path, why in skipped:
        report(f"Skipping checkpoint {path}: {why}. Resuming from the newest one before it that loads.")
    return found


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
