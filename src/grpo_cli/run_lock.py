"""One run at a time in a run folder: an advisory lock on RUN/.grpo-train.lock while a run lives.

Two runs in one folder interleave metrics.jsonl line by line and overwrite each other's
checkpoints, and each believes its own. The lock is `flock` on a file in the folder, so the
kernel drops it when the holder ends in any way (kill -9 included): there is no stale lock to
clean up. The file holds the holder's pid, host and start time, for the message the next run
prints. On a network file system without flock the run goes on unlocked (the call fails there).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from grpo_cli.config import ConfigError

LOCK_FILE = ".grpo-train.lock"


@contextlib.contextmanager
def hold_run_folder(output_dir: Path) -> Iterator[None]:
    """Hold the run folder's lock within; ConfigError naming the other run when it is held."""
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / LOCK_FILE
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            raise ConfigError(
                f"{output_dir} is in use by another grpo-train run ({_holder(handle.read())}): two runs in "
                "one folder would interleave metrics.jsonl and overwrite each other's checkpoints. Wait "
                "for it to end (or stop it), or give this run another folder (hydra.run.dir=...)."
            ) from None
        except OSError:  # no flock on this file system: nothing to hold
            yield
            return
        handle.seek(0)
        handle.truncate()
        handle.write(
            json.dumps(
                {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
            )
            + "\n"
        )
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _holder(text: str) -> str:
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
    except (ValueError, KeyError, TypeError):
        return "its process wrote no details"
