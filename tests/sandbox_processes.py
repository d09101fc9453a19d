"""The processes on this machine, for the sandbox tests' checks that nothing of a run is left."""

from __future__ import annotations

import os
from pathlib import Path


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
