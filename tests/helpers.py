"""Running the real `grpo-train` entry point from tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

GRPO_TRAIN = str(Path(sys.executable).parent / "grpo-train")


def grpo_train(*overrides: str, cwd: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """`grpo-train OVERRIDES...` in a child process; raises with its output if it fails."""
    result = subprocess.run(
        [GRPO_TRAIN, *overrides], capture_output=True, text=True, cwd=cwd,
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=900,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"grpo-train failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result
