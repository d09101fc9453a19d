"""Checkpoints: a loadable model folder plus everything needed to continue the run exactly.

Layout of one checkpoint, `OUTPUT_DIR/checkpoints/step-000050/`:
- the model as `save_pretrained` writes it (full weights, or a PEFT adapter folder with LoRA)
  and the tokenizer, so `from_pretrained(folder)` / `PeftModel.from_pretrained(base, folder)`
  load it directly;
- `trainer_state.pt`: optimizer, scheduler, RNG states, data position, step;
- `meta.json`: step, that step's mean reward and KL, written last: a folder without it is
  incomplete and never resumed from.
Each checkpoint is written into a hidden temporary folder, flushed to disk, then renamed into
place, so a run killed mid-save leaves the previous checkpoints intact.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

STATE_FILE = "trainer_state.pt"
META_FILE = "meta.json"


def checkpoints_dir(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())


def save_checkpoint(
    output_dir: Path,
    step: int,
    policy: torch.nn.Module,
    tokenizer: Any,
    trainer_state: dict[str, Any],
    meta: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write checkpoint `step` atomically, then delete all but the newest `keep_last`."""
    root = checkpoints_dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    staging = root / f".partial-{final.name}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    policy.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    torch.save({**trainer_state, "step": step, "rng": rng_state()}, staging / STATE_FILE)
    (staging / META_FILE).write_text(json.dumps({"step": step, **meta}, indent=2) + "\n")
    _fsync_tree(staging)
    if final.exists():  # a rerun of the same step replaces the old copy
        shutil.rmtree(final)
    os.replace(staging, final)
    for old in complete_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Finished checkpoints of a run, oldest first."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if (p / META_FILE).is_file() and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(output_dir: Path) -> Optional[Path]:
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    # Our own file, holding numpy RNG state and optimizer tensors: not a weights-only pickle.
    return torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=False)
