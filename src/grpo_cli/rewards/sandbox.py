"""Running untrusted Python in a child process that cannot hurt the trainer.

`run_sandboxed(source, timeout)` runs one program; `run_connected(first, second, timeout)` runs
two at once, each in a sandbox of its own, joined only by two pipes (the code reward's model code
and its tests). Each run writes the program into a fresh temporary folder and starts the
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
import threading
import time
from dataclasses import dataclass
from pathlib import Path

RUNNER = Path(__file__).with_name("sandbox_runner.py")
SANDBOX_UID_BASE = 1_900_000_000  # + the runner's pid: one uid per run, owned by nobody else
TAIL_BYTES = 1024
DRAIN_AFTER_EXIT_S = 0.5  # how long to keep reading after the runner exited
MAX_FILE_BYTES = 16 << 20  # RLIMIT_FSIZE of a program
MAX_PROCESSES = 32  # RLIMIT_NPROC of a program's uid
CONNECTED_GRACE_S = 1.0  # run_connected: the first program's deadline after the second's


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


def run_sandboxed(
    source: str,
    timeout: float,
    memory_mb: int = 512,
    max_output_bytes: int = 64_000,
    max_file_bytes: int = MAX_FILE_BYTES,
    max_processes: int = MAX_PROCESSES,
    use_namespaces: bool = True,
) -> SandboxResult:
    """Run `source` as a Python program in a fresh sandboxed process. See the module docstring.

    `max_file_bytes` caps any file the program writes (RLIMIT_FSIZE), `max_processes` the
    processes and threads of its uid (RLIMIT_NPROC; effective only where the uid was dropped or
    a user namespace applied). `use_namespaces=False` skips the namespaces, to exercise the
    fallbacks (tests) or where a seccomp profile makes unshare misbehave."""
    limits = _Limits(timeout, memory_mb, max_file_bytes, max_processes, use_namespaces)
    return _finish(_start(source, limits, program_fds=()), max_output_bytes)


def run_connected(
    first: str,
    second: str,
    timeout: float,
    memory_mb: int = 512,
    max_output_bytes: int = 64_000,
    use_namespaces: bool = True,
) -> tuple[SandboxResult, SandboxResult]:
    """Run two programs at once, each in a sandbox of its own, joined by two pipes and nothing
    else: each finds the file descriptors of its ends as `sys.argv[1]` (it reads there) and
    `sys.argv[2]` (it writes there). When `second` has ended, `first` is killed: `second` holds
    the verdict (the code reward's tests), `first` only serves it (the model's code). So
    `first`'s wall-clock deadline comes CONNECTED_GRACE_S after `second`'s: a `first` that
    hangs is ended by `second`'s timeout, not by its own a moment earlier (which `second`
    would see as a closed pipe, not as a timeout). Neither can see, signal or read the files
    of the other: separate namespaces and uids."""
    limits = _Limits(timeout, memory_mb, MAX_FILE_BYTES, MAX_PROCESSES, use_namespaces)
    first_reads, second_writes = os.pipe()
    second_reads, first_writes = os.pipe()
    try:
        first_run = _start(first, limits, program_fds=(first_reads, first_writes), grace=CONNECTED_GRACE_S)
        try:
            second_run = _start(second, limits, program_fds=(second_reads, second_writes))
        except BaseException:
            _kill_group(first_run.process.pid)
            _finish(first_run, max_output_bytes)
            raise
    finally:  # each end lives on in its sandbox only: an end's death is the other's EOF
        for fd in (first_reads, first_writes, second_reads, second_writes):
            os.close(fd)
    # The solution's run is waited on in a thread, which alone polls (and so reaps) its runner:
    # told to stop, it kills the runner's group before reaping it, never a reused pid.
    stop_first = threading.Event()
    first_result: list[SandboxResult] = []
    waiter = threading.Thread(target=lambda: first_result.append(_finish(first_run, max_output_bytes, stop=stop_first)))
    waiter.start()
    try:
        second_result = _finish(second_run, max_output_bytes)
    finally:
        stop_first.set()
        waiter.join()
    return first_result[0], second_result


@dataclass(frozen=True)
class _Limits:
    timeout: float
    memory_mb: int
    max_file_bytes: int
    max_processes: int
    use_namespaces: bool


@dataclass
class _Started:
    """A runner started by `_start`, for `_finish` to wait on and clean up."""

    process: subprocess.Popen
    folder: Path  # the temporary folder holding the program; removed by _finish
    report_fd: int  # the read end of the runner's report pipe
    started: float  # time.monotonic() before the program was written
    deadline: float  # time.monotonic() at which the runner's group is killed


def _start(source: str, limits: _Limits, program_fds: tuple[int, ...], grace: float = 0.0) -> _Started:
    """Write the program and start the runner on it; `program_fds` reach the program (their
    numbers follow the program's name in its argv). Raises OSError when no child can start."""
    started = time.monotonic()
    folder = Path(tempfile.mkdtemp(prefix="grpo-sandbox-"))
    os.chmod(folder, 0o711)  # the dropped uid must reach folder/work when no mount namespace
    program = folder / "source.py"
    # Owner only: the runner reads it before dropping its uid, and another sandbox (the model's
    # code, beside its tests) must not, wherever the temporary folder is.
    program.touch(mode=0o600)
    program.write_bytes(source.encode("utf-8", "replace"))
    report_read, report_write = os.pipe()
    try:
        process = subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-S",
                str(RUNNER),
                str(program),
                str(folder / "work"),
                str(report_write),
                str(limits.timeout),
                str(limits.memory_mb),
                str(limits.max_file_bytes),
                str(limits.max_processes),
                str(SANDBOX_UID_BASE),
                str(int(limits.use_namespaces)),
                ",".join(map(str, program_fds)),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            cwd=folder,
            start_new_session=True,
            pass_fds=(report_write, *program_fds),
        )
    except BaseException:
        os.close(report_read)
        shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        os.close(report_write)
    return _Started(process, folder, report_read, started, started + limits.timeout + grace)


def _finish(run: _Started, max_output_bytes: int, stop: threading.Event | None = None) -> SandboxResult:
    """Wait for the runner (killing its group at the deadline, or once `stop` is set), kill
    whatever of it is left, remove its folder, and say what happened."""
    process = run.process
    streams = {process.stdout: _CappedStream(max_output_bytes), process.stderr: _CappedStream(max_output_bytes)}
    report = _CappedStream(8192)
    timed_out = _pump(process, streams, run.report_fd, report, deadline=run.deadline, stop=stop)
    sandbox_uid = SANDBOX_UID_BASE + process.pid
    _kill_all(process, sandbox_uid)
    process.wait()
    shutil.rmtree(run.folder, ignore_errors=True)
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
        wall_s=time.monotonic() - run.started,
    )


def _pump(
    process: subprocess.Popen,
    streams: dict,
    report_fd: int,
    report: _CappedStream,
    deadline: float,
    stop: threading.Event | None = None,
) -> bool:
    """Read the pipes until they close (or shortly after the runner exited); True when the
    deadline came first, in which case the runner's process group was killed. Once `stop` is
    set, the group is killed (if the runner was not reaped yet) and the pipes drained."""
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
            if stop is not None and stop.is_set():
                if exited_at is None:  # not reaped: its pid, and so its group, are still its own
                    _kill_group(process.pid)
                stop = None
            if exited_at is None and process.poll() is not None:
                exited_at = now
            if exited_at is not None and (not selector.get_map() or now - exited_at > DRAIN_AFTER_EXIT_S):
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
