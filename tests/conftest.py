"""Shared test set-up: nothing is downloaded, built tiny models are cached once per checkout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[1]

# Set before any test imports transformers: the hub is never contacted, and the tiny model is
# built once into the checkout's own cache (ignored by git) and reused by every test.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("GRPO_CLI_CACHE", str(PROJECT_ROOT / ".cache" / "grpo-cli"))


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from grpo_cli.tiny import resolve_builtin

    return Path(resolve_builtin("builtin:tiny-addition"))
