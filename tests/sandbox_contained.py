"""The `contained` fixture of the sandbox tests: afterwards, nothing of the runs is left."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from grpo_cli.rewards import sandbox
from grpo_cli.rewards.sandbox import SANDBOX_UID_BASE


def live_processes() -> dict[int, tuple[int, int, str]]:
    """pid -> (uid, process group, command line) for every live, non-zombie process."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()  # after "(comm)": state, ppid, pgrp, ...
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if fields[0] != "Z":
                found[int(name)] = (os.stat(f"/proc/{name}").st_uid, int(fields[2]), cmdline)
        except (OSError, IndexError, ValueError):
            continue
    return found


@pytest.fixture
def contained(monkeypatch, tmp_path):
    """Records the runner of every sandbox run; afterwards asserts nothing of them is left."""
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
    leaked = {pid: info for pid, info in live_processes().items()
              if info[0] in uids or info[1] in runners}
    assert not leaked, f"processes left behind: {leaked}"
    assert list(sandboxes.iterdir()) == [], "a temporary folder was left behind"
