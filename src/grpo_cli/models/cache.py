"""The cache of model folders grpo-cli makes itself (the built tiny models, the converted GGUF
models), and how a folder gets there whole even when two processes make it at once."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def cache_root() -> Path:
    """Where built and converted models live: $GRPO_CLI_CACHE, else ~/.cache/grpo-cli."""
    return Path(os.environ.get("GRPO_CLI_CACHE", Path.home() / ".cache" / "grpo-cli"))


def save_folder_atomically(folder: Path, *parts) -> None:
    """`save_pretrained` of each part (a model, a tokenizer) into a staging folder beside
    `folder`, renamed to `folder` at the end: a killed save leaves no half folder behind, and a
    folder another process finished first is kept."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        for part in parts:
            part.save_pretrained(staging)
        try:
            staging.rename(folder)
        except OSError:
            if not (folder / "config.json").is_file():
                raise
            shutil.rmtree(staging)  # another process (a torchrun rank) finished first: theirs
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
