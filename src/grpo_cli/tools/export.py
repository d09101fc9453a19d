"""`grpo-export RUN_OR_CHECKPOINT OUT_DIR [--best]`: a checkpoint as a plain Hugging Face model
folder; of a run folder, its newest checkpoint, or with --best the best by trainer.best_metric.

A LoRA checkpoint is a PEFT adapter folder: serving engines want one full model. The export
loads the base model the run trained on (in the run's dtype, never quantized: a QLoRA adapter
is merged into the full-precision base, the weights it approximated), attaches the adapter,
merges it into the weights (W + B A x alpha / r) and saves model + tokenizer. A full
fine-tune's checkpoint is already a model folder; it is loaded and saved the same way, so the
output never carries the trainer's own files (trainer_state.pt, meta.json).

Bad input (no checkpoint, an output folder that is not empty, a base model that is not on this
machine) ends in one message and exit code 2, like grpo-train's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NoReturn, Optional

from grpo_cli.checkpoint import META_FILE, best_checkpoint, latest_checkpoint, ranking_value, read_meta

ADAPTER_CONFIG = "adapter_config.json"


class ExportError(Exception):
    """Input grpo-export cannot use; the message says which path and what to do."""


def find_checkpoint(path: Path, best: bool = False) -> Path:
    """A checkpoint folder, or the newest (`best`: the best ranked) complete checkpoint of a run folder."""
    if not path.exists():
        raise ExportError(
            f"{path} does not exist. Give a run folder (its newest checkpoint is exported) "
            "or a checkpoint folder such as RUN/checkpoints/step-000100."
        )
    if (path / META_FILE).is_file():
        if best:
            raise ExportError(
                f"{path} is one checkpoint; --best picks among a run's checkpoints. Give the run "
                f"folder ({path.parent.parent}) with --best, or this checkpoint without it."
            )
        return path
    newest = latest_checkpoint(path)
    if best and newest is not None:
        chosen = best_checkpoint(path)
        if chosen is None:
            metric = ranking_value(read_meta(newest))[0]
            raise ExportError(
                f"No checkpoint of {path} has a value of {metric} (trainer.best_metric) to rank it by: "
                "an eval metric is only known at eval steps. Export one checkpoint by its folder, "
                "e.g. the newest, " + str(newest) + "."
            )
        return chosen
    if newest is None:
        raise ExportError(
            f"{path} is neither a checkpoint (no {META_FILE}) nor a run folder with a complete "
            "checkpoint under checkpoints/. Give RUN or RUN/checkpoints/step-NNNNNN."
        )
    return newest


def run_settings(checkpoint: Path) -> dict:
    """The model settings of the run that wrote `checkpoint` (RUN/config.yaml), or {} if the
    checkpoint was copied away from its run folder."""
    from omegaconf import OmegaConf

    saved = checkpoint.parent.parent / "config.yaml"
    if not saved.is_file():
        return {}
    return OmegaConf.to_container(OmegaConf.load(saved).model, resolve=True)


def base_model_of(checkpoint: Path, settings: dict) -> str:
    """Where the adapter's base model is: the run's model.name_or_path (builtin names resolved),
    else what PEFT recorded in adapter_config.json."""
    from grpo_cli.models.sources import resolve_model

    name = settings.get("name_or_path") or json.loads((checkpoint / ADAPTER_CONFIG).read_text()).get(
        "base_model_name_or_path"
    )
    if not name:
        raise ExportError(
            f"{checkpoint / ADAPTER_CONFIG} names no base model and the run's config.yaml is "
            "not two folders up. Export from inside the run folder."
        )
    return resolve_model(name)  # builtin:NAME or a .gguf -> its local folder; else unchanged


def export(source: Path, out: Path, dtype_name: Optional[str] = None, best: bool = False) -> Path:
    """Write the merged (or copied) model and its tokenizer to `out`; returns the checkpoint used."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = find_checkpoint(source, best)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(
            f"{out} already exists and is not an empty folder; the export never overwrites. Give a new OUT_DIR."
        )
    settings = run_settings(checkpoint)
    dtype_name = dtype_name or settings.get("dtype", "auto")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype_name, "auto")
    if (checkpoint / ADAPTER_CONFIG).is_file():
        from peft import PeftModel

        base_path = base_model_of(checkpoint, settings)
        try:
            base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
        except OSError as error:
            raise ExportError(
                f"Cannot load the base model {base_path} of the adapter in {checkpoint}: "
                f"{str(error).splitlines()[0]}. Put the base model on this machine (or in the "
                "Hugging Face cache) and run grpo-export again."
            ) from None
        model = PeftModel.from_pretrained(base, checkpoint).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(checkpoint).save_pretrained(out)
    return checkpoint


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="grpo-export",
        description="Write a grpo-train checkpoint as a full Hugging Face model folder (LoRA adapters are "
        "merged into their base model) with its tokenizer, for any HF-compatible engine.",
    )
    parser.add_argument("source", type=Path, help="a run folder (its newest checkpoint) or a checkpoint folder")
    parser.add_argument("out", type=Path, help="a new (or empty) folder to write the model to")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="the exported weights' dtype (default: the run's model.dtype)",
    )
    parser.add_argument(
        "--best",
        action="store_true",
        help="of a run folder, the checkpoint best by the run's trainer.best_metric (kept by keep_best) "
        "instead of the newest",
    )
    arguments = parser.parse_args(argv)
    try:
        used = export(arguments.source, arguments.out, arguments.dtype, arguments.best)
    except ExportError as error:
        fail(str(error))
    print(f"Exported {used} to {arguments.out}")


def fail(message: str) -> NoReturn:
    print(f"grpo-export: error {message}", file=sys.stderr)
    sys.exit(2)
