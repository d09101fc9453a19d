"""Running untrusted Python in a child process that cannot hurt the trainer.

`run_sandboxed(source, timeout)` writes the program into a fresh temporary folder and starts the
trusted runner (`sandbox_runner.py`) as a new session, with a minimal environment and stdin
closed. The runner isolates itself (namespaces, read-only tree, fresh tmpfs, hidden home folders
and /run, rlimits, uid drop, a seccomp filter; see docs/SANDBOX.md) and runs the program as its
own child. This side only waits: it reads the output pipes with a cap, kills the whole process
group at the wall-clock timeout, and at the end kills whatever is left (the process group, and
every process of the sandbox's uid). It never raises on anything the program does; it raises
OSError only when no child can be started at all.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

RUNNER = Path(__file__).with_name("sandbox_runner.py")
SANDBOX_UID_BASE = 1_900_000_000  # + the runner's pid: one uid per run, owned by nobody else
TAIL_BYTES = 1024
DRAIN_AFTER_EXIT_S = 0.5  # how long to keep reading after the runner exited


@dataclass
class SandboxResult:
    exit_code: int | None  # the program's; 128 + signal when killed; None when timed out
    timed_out: bool  # the wall-clock timeout (or the CPU-time limit) ended it
    stdout: str  # the first max_output_bytes, decoded with errors replaced
    stderr: str  # idem
    isolation: str  # what applied, comma-separated ("mountns,netns,pidns,...,uid=...,seccomp")
    stdout_tail: str = ""  # the last TAIL_BYTES of stdout, even when stdout was truncated
    truncated: bool = False  # some output beyond max_output_bytes was thrown away
    wall_s: float = 0.0


class _CappedStream:
    """Keeps the first `cap` bytes and the last TAIL_BYTES; counts and drops the rest."""

    def __init__(self, cap: int):
        self.cap, self.head, self.tail, self.total = cap, bytearray(), b"", 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if len(self.head) < self.cap:
            self.head += chunk[: self.cap - len(self.head)]
        self.tail = (self.tail + chunk)[-TAIL_BYTES:]


def run_sandboxed(source: str, timeout: float, memory_mb: int = 512,
                  max_output_bytes: int = 64_000, max_file_bytes: int = 16 << 20,
                  max_processes: int = 32, use_namespaces: bool = True) -> SandboxResult:
    """Run `source` as a Python program in a fresh sandboxed process. See the module docstring.

    `max_file_bytes` caps any file the program writes (RLIMIT_FSIZE), `max_processes` the
    processes and threads of its uid (RLIMIT_NPROC; effective only where the uid was dropped or
    a user namespace applied). `use_namespaces=False` skips the namespaces, to exercise the
    fallbacks (tests) or where a seccomp profile makes unshare misbehave."""
    started = time.monotonic()
    folder = Path(tempfile.mkdtemp(prefix="grpo-sandbox-"))
    os.chmod(folder, 0o711)  # the dropped uid must reach folder/work when no mount namespace
    program = folder / "source.py"
    program.write_bytes(source.encode("utf-8", "replace"))
    report_read, report_write = os.pipe()
    try:
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", str(RUNNER), str(program), str(folder / "work"),
             str(report_write), str(timeout), str(memory_mb), str(max_file_bytes),
             str(max_processes), str(SANDBOX_UID_BASE), str(int(use_namespaces))],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, cwd=folder,
            start_new_session=True, pass_fds=(report_write,),
        )
    except BaseException:
        os.close(report_read)
        shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        os.close(report_write)
    streams = {process.stdout: _CappedStream(max_output_bytes),
               process.stderr: _CappedStream(max_output_bytes)}
    report = _CappedStream(8192)
    timed_out = _pump(process, streams, report_read, report, deadline=started + timeout)
    sandbox_uid = SANDBOX_UID_BASE + process.pid
    _kill_all(process, sandbox_uid)
    process.wait()
    shutil.rmtree(folder, ignore_errors=True)
    stdout, stderr = streams[process.stdout], streams[process.stderr]
    exit_code = process.returncode
    if exit_code is not None and exit_code < 0:  # the runner itself was killed
        exit_code = 128 - exit_code
    if exit_code == 128 + signal.SIGXCPU:
        timed_out = True
    return SandboxResult(
        exit_code=None if timed_out else exit_code,
        timed_out=timed_out,
        stdout=bytes(stdout.head).decode("utf-8", "replace"),
        stderr=bytes(stderr.head).decode("utf-8", "replace"),
        isolation=_describe(bytes(report.head)),
        stdout_tail=stdout.tail.decode("utf-8", "replace"),
        truncated=stdout.total > max_output_bytes or stderr.total > max_output_bytes,
        wall_s=time.monotonic() - started,
    )


def _pump(process: subprocess.Popen, streams: dict, report_fd: int, report: _CappedStream,
          deadline: float) -> bool:
    """Read the pipes until they close (or shortly after the runner exited); True when the
    deadline came first, in which case the runner's process group was killed."""
    selector = selectors.DefaultSelector()
    for stream in streams:
        selector.register(stream.fileno(), selectors.EVENT_READ, streams[stream])
    selector.register(report_fd, selectors.EVENT_READ, report)
    exited_at = None
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                _kill_group(process.pid)
                return True
            if exited_at is None and process.poll() is not None:
                exited_at = now
            if exited_at is not None and (not selector.get_map()
                                          or now - exited_at > DRAIN_AFTER_EXIT_S):
                return False  # a grandchild may hold a pipe open: it is killed next
            if not selector.get_map():
                time.sleep(min(0.05, deadline - now))
                continue
            for key, _ in selector.select(timeout=min(0.1, deadline - now)):
                chunk = os.read(key.fd, 65536)
                if chunk:
                    key.data.feed(chunk)
                else:
                    selector.unregister(key.fd)
    finally:
        selector.close()
        os.close(report_fd)
        for stream in streams:
            stream.close()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_all(process: subprocess.Popen, sandbox_uid: int) -> None:
    """SIGKILL the runner's process group and every process of the sandbox's uid, until none is
    left running (with a pid namespace the kernel already killed them when the program exited).
    Waits until they are dead, not merely signalled, so a caller sees a clean process table."""
    _kill_group(process.pid)
    for _ in range(100):
        survivors = _survivors(process.pid, sandbox_uid)
        if not survivors:
            return
        for pid in survivors:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)


def _survivors(pgid: int, uid: int) -> list[int]:
    """Processes, not yet dead, in process group `pgid` or owned by `uid` (one /proc scan)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            owner = os.stat(f"/proc/{name}").st_uid
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue
        if fields[0] not in (b"Z", b"X") and (owner == uid or int(fields[2]) == pgid):
            found.append(int(name))
    return found


def _describe(report: bytes) -> str:
    """The runner's JSON report as one line: "mountns,netns,...; notes: ..."."""
    try:
        parsed = json.loads(report.decode("utf-8", "replace").splitlines()[0])
        text = ",".join(parsed["applied"])
        return f"{text}; notes: {' | '.join(parsed['notes'])}" if parsed["notes"] else text
    except (ValueError, IndexError, KeyError, TypeError):
        return "unknown (the runner sent no report)"
