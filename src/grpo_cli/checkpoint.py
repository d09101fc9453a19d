"""Checkpoints: a loadable model folder plus everything needed to continue the run exactly.

Layout of one checkpoint, `OUTPUT_DIR/checkpoints/step-000050/`:
- the model as `save_pretrained` writes it (full weights, or a PEFT adapter folder with LoRA)
  and the tokenizer, so `from_pretrained(folder)` / `PeftModel.from_pretrained(base, folder)`
  load it directly;
- `trainer_state.pt`: optimizer, scheduler, RNG states, data position, step;
- `reference.safetensors`, with trainer.ref_sync_steps only: the refreshed reference's weights;
- `meta.json`: step, that step's mean reward and KL, written last: a folder without it is
  incomplete and never resumed from.
Each checkpoint is written into a hidden temporary folder, flushed to disk, then renamed into
place (and the rename flushed), so a run killed mid-save leaves the previous checkpoints
intact. Kept: the newest `trainer.keep_last` and the `trainer.keep_best` with the best
`trainer.best_metric` (meta.json's `best_value`; the mean reward by default).
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model, save_model

from grpo_cli.config import ConfigError

STATE_FILE = "trainer_state.pt"
META_FILE = "meta.json"
REFERENCE_FILE = "reference.safetensors"  # a refreshed reference (trainer.ref_sync_steps)


def checkpoints_dir(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and plain values, so trainer_state.pt loads weights-only."""
    numpy_state = np.random.get_state(legacy=False)  # {bit_generator, state: {key, pos}, has_gauss, gauss}
    numpy_state["state"] = {
        "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
        "pos": int(numpy_state["state"]["pos"]),
    }
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):  # ours; a checkpoint of an older grpo-cli holds numpy's tuple
        key = np.asarray(numpy_state["state"]["key"].numpy(), dtype=np.uint32)
        numpy_state = {**numpy_state, "state": {"key": key, "pos": numpy_state["state"]["pos"]}}
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    """Make a rename or a new entry in `folder` durable (a crash could otherwise undo it)."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class CheckpointError(ConfigError):
    """A checkpoint could not be written (disk full, no permission). The CLI prints it, exits 2."""


def save_checkpoint(
    output_dir: Path,
    step: int,
    policy: torch.nn.Module,
    tokenizer: Any,
    trainer_state: dict[str, Any],
    meta: dict[str, Any],
    keep_last: int,
    keep_best: int = 0,
    model_state: Optional[dict[str, Any]] = None,
    reference: Optional[torch.nn.Module] = None,
) -> Path:
    """Write checkpoint `step` atomically, then delete all but the newest `keep_last` and the
    `keep_best` best by their meta.json (ranking_value). `model_state`: the policy's
    full state dict when the model itself holds only shards (FSDP); else the model is read.
    `reference`: a reference that moves (trainer.ref_sync_steps), saved beside the policy.

    A failure while writing (disk full, ...) removes the partial copy and raises CheckpointError
    saying which complete checkpoint survived."""
    root = checkpoints_dir(output_dir)
    final = root / f"step-{step:06d}"
    staging = root / f".partial-{final.name}"
    broken = non_finite_tensor(model_state if model_state is not None else policy.state_dict())
    if broken is not None:  # saved, it would become the newest, and rotation would delete a good one
        survivor = latest_checkpoint(output_dir)
        raise CheckpointError(
            f"The policy's weights hold NaN or inf at step {step} ({broken}), so checkpoint {final} was not "
            f"written; {f'the newest checkpoint, {survivor}, is kept' if survivor else 'no checkpoint exists yet'}. "
            "The run stopped: lower optimizer.lr (or set optimizer.max_grad_norm), then continue from a "
            "good checkpoint with trainer.resume=true (or trainer.guard.enabled=true to roll back on its own)."
        )
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        policy.save_pretrained(staging, state_dict=model_state)
        tokenizer.save_pretrained(staging)
        torch.save({**trainer_state, "step": step, "rng": rng_state()}, staging / STATE_FILE)
        if reference is not None:
            save_model(reference, str(staging / REFERENCE_FILE))  # tied weights stored once
        (staging / META_FILE).write_text(json.dumps({"step": step, **meta}, indent=2) + "\n")
        _fsync_tree(staging)
    except (OSError, RuntimeError, SafetensorError) as error:  # torch.save says a full disk as a RuntimeError
        reason = _why_not_written(error, root)  # before the partial copy is removed: the disk is still full
        shutil.rmtree(staging, ignore_errors=True)
        survivor = latest_checkpoint(output_dir)
        kept = f"the newest complete checkpoint, {survivor}, is intact" if survivor else "no earlier checkpoint exists"
        raise CheckpointError(
            f"Could not write checkpoint {final}: {reason}. The partial copy was "
            f"removed and {kept}. Free space (or fix the folder's permissions), then continue "
            "with trainer.resume=true."
        ) from None
    if final.exists():  # a rerun of the same step replaces the old copy
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_dir(root)
    for old in checkpoints_to_delete(complete_checkpoints(output_dir), keep_last, keep_best):
        shutil.rmtree(old, ignore_errors=True)
    return final


def _why_not_written(error: BaseException, root: Path) -> str:
    """The reason in the user's words. torch.save reports a full disk as "[enforce fail at
    inline_container.cc:672] unexpected pos ..." and safetensors as an IoError: where the disk has
    almost no room left (under 64 MiB, the partial copy still on it), that is the reason."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    try:
        nearly_full = shutil.disk_usage(root).free < 64 * 2**20
    except OSError:
        nearly_full = False
    return "No space left on device" if nearly_full else _first_line(error)


def non_finite_tensor(state: dict[str, Any]) -> Optional[str]:
    """The name of the first floating tensor of a state dict that holds NaN or inf, else None."""
    for name, tensor in state.items():
        if torch.is_tensor(tensor) and tensor.is_floating_point() and not torch.isfinite(tensor).all():
            return name
    return None


def ranking_value(meta: dict[str, Any]) -> tuple[str, Optional[float]]:
    """(the metric a checkpoint is ranked by, its value with the higher the better), from its
    meta.json: `best_metric`, `best_value` and `best_metric_mode` (trainer.best_metric), or
    reward/mean for checkpoints written before those keys. No value (an eval metric at a step
    without eval): None, never the best."""
    if "best_metric" not in meta:
        value = meta.get("reward_mean")
        return "reward/mean", float(value) if isinstance(value, (int, float)) else None
    value = meta.get("best_value")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:  # NaN
        return str(meta["best_metric"]), None
    return str(meta["best_metric"]), -float(value) if meta.get("best_metric_mode") == "min" else float(value)


def checkpoints_to_delete(checkpoints: list[Path], keep_last: int, keep_best: int) -> list[Path]:
    """All but the newest `keep_last` (oldest first in `checkpoints`) and the `keep_best` best by
    the newest checkpoint's metric (ranking_value; ties: the newer one). Checkpoints ranked by
    another metric (the run was resumed with another trainer.best_metric) are not compared."""
    newest = set(checkpoints[-keep_last:]) if keep_last > 0 else set()
    ranks = [ranking_value(read_meta(path)) for path in checkpoints]
    metric = ranks[-1][0] if ranks else None
    scored = [(value, index, path) for index, ((name, value), path) in enumerate(zip(ranks, checkpoints))]
    ranked = sorted((item for item in scored if item[0] is not None and ranks[item[1]][0] == metric), reverse=True)
    best = {path for _, _, path in ranked[:keep_best]}
    return [path for path in checkpoints if path not in newest | best]


def read_meta(checkpoint: Path) -> dict[str, Any]:
    try:
        return json.loads((checkpoint / META_FILE).read_text())
    except (OSError, ValueError):
        return {}


def best_checkpoint(output_dir: Path) -> Optional[Path]:
    """The complete checkpoint best by trainer.best_metric (checkpoints_to_delete; ties: the
    newest); None if none has a value."""
    kept = complete_checkpoints(output_dir)
    survivors = [path for path in kept if path not in checkpoints_to_delete(kept, 0, 1)]
    return survivors[0] if survivors else None


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


# What an older grpo-cli's trainer_state.pt needs beyond tensors and plain values: numpy's RNG
# key, a uint32 array. These only rebuild an array of plain numbers; they call nothing else.
OLD_STATE_GLOBALS = (
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
    importlib.import_module(
        "numpy._core.multiarray" if np.__version__ >= "2" else "numpy.core.multiarray"
    )._reconstruct,
)


def load_trainer_state(checkpoint: Path, mmap: bool = False) -> dict[str, Any]:
    """trainer_state.pt, loaded weights-only: tensors and plain values, never code.

    A checkpoint may come from a colleague, a bucket or a hub, and a full unpickling runs whatever
    a pickled object's __reduce__ names (os.system, ...). A run writes nothing else into this
    file, so anything else is refused, with the name of what the file asked for. `mmap`: map
    the tensors instead of reading them (to check a file cheaply)."""
    path = checkpoint / STATE_FILE
    try:
        with torch.serialization.safe_globals(list(OLD_STATE_GLOBALS)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        # torch names what the file asked for in one of two wordings
        asked = re.search(r"GLOBAL ([\w.]+)|but got <class '([\w.]+)'>", str(error))
        what = f"a {asked.group(1) or asked.group(2)}" if asked else "an object"
        raise CheckpointError(
            f"{path} holds {what}, not only tensors and plain "
            "values: grpo-cli never writes that, and unpickling it could run any code the file carries. "
            "It was not loaded. Resume only from checkpoints a grpo-cli run wrote."
        ) from None


def checkpoint_damage(checkpoint: Path) -> Optional[str]:
    """Why a complete checkpoint cannot be resumed (a file cut off, overwritten, missing, or
    holding code), else None. Cheap: the weights' headers are read, the trainer state is mapped."""
    try:
        if not isinstance(json.loads((checkpoint / META_FILE).read_text()), dict):
            return f"{META_FILE} is not a JSON object"
    except (OSError, ValueError) as error:
        return f"{META_FILE} cannot be read ({error})"
    if not (checkpoint / "adapter_config.json").is_file() and not (checkpoint / "config.json").is_file():
        return "it has no config.json (nor adapter_config.json): no model can be loaded from it"
    weights = sorted(checkpoint.glob("*.safetensors"))
    if not weights:
        return "it holds no .safetensors weights"
    for file in weights:
        try:
            with safe_open(file, "pt"):
                pass
        except (SafetensorError, OSError) as error:
            return f"{file.name} is cut off or damaged ({error})"
    try:
        load_trainer_state(checkpoint, mmap=True)
    except CheckpointError as error:
        return str(error)
    except Exception as error:  # torch's zip reader fails in many ways on a cut-off or foreign file
        return f"{STATE_FILE} cannot be read: it is cut off, or not a file torch.save wrote ({_first_line(error)})"
    return None


def newest_resumable(output_dir: Path) -> tuple[Optional[Path], list[tuple[Path, str]]]:
    """The newest complete checkpoint of a run that can be resumed, and the newer ones passed over
    as damaged, newest first, each with why (checkpoint_damage)."""
    skipped: list[tuple[Path, str]] = []
    for checkpoint in reversed(complete_checkpoints(output_dir)):
        damage = checkpoint_damage(checkpoint)
        if damage is None:
            return checkpoint, skipped
        skipped.append((checkpoint, damage))
    return None, skipped


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def load_reference_weights(reference: Optional[torch.nn.Module], checkpoint: Path) -> bool:
    """A refreshed reference's weights back from `checkpoint`, if it holds them (a checkpoint
    written before the first refresh does not: the reference was still the base model). True
    when they were loaded."""
    path = checkpoint / REFERENCE_FILE
    if reference is None or not path.is_file():
        return False
    try:
        load_model(reference, str(path), device=str(next(reference.parameters()).device))
    except (OSError, RuntimeError, SafetensorError) as error:
        raise CheckpointError(
            f"{path}: the refreshed reference of this checkpoint cannot be loaded ({_first_line(error)}). "
            "Resume from another checkpoint (trainer.resume=PATH)."
        ) from None
    return True


def load_policy_weights(policy: torch.nn.Module, checkpoint: Path, sharded: bool = False) -> None:
    """Put a checkpoint's trained weights back into the live policy (the guard's rollback):
    the LoRA adapter for a PEFT model, else every tensor of the model's safetensors files.

    `sharded` (FSDP): the parameters are DTensors holding this rank's shard, which refuse a
    plain load_state_dict; torch's set_model_state_dict shards the full tensors as it loads
    them (a collective: every rank calls it with the same file)."""
    from safetensors.torch import load_file

    adapter = hasattr(policy, "peft_config")
    files = [checkpoint / "adapter_model.safetensors"] if adapter else sorted(checkpoint.glob("*.safetensors"))
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        weights.update(load_file(path))
    if adapter and not sharded:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(policy, weights)
        return
    if adapter:  # PEFT saves `...lora_A.weight` for the live `...lora_A.default.weight`: put the name back
        adapter_name = f".{policy.active_adapter}"
        live_names = {name.replace(adapter_name, ""): name for name in policy.state_dict()}
        weights = {live_names.get(name, name): tensor for name, tensor in weights.items()}
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        result = set_model_state_dict(policy, weights, options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        result = policy.load_state_dict(weights, strict=False)
    if result.unexpected_keys or not weights:
        raise CheckpointError(
            f"{checkpoint} does not hold this model's weights (unexpected: {result.unexpected_keys[:5]})."
        )
