"""Stage 3, the code-execution reward and its sandbox: hostile programs stay contained.

Every hostile test checks, through the `contained` fixture, that afterwards no process of the
runs it started is left (by the runner's process group and by the sandbox uid) and no temporary
folder is left. Timeouts are short (1-2 s) so the whole file runs in well under a minute.
"""

from __future__ import annotations

import os
import pwd
import resource
import socket
import time
import uuid
from pathlib import Path

import pytest

from grpo_cli.rewards.code import code_execution, extract_code
from grpo_cli.rewards.sandbox import SANDBOX_UID_BASE, run_sandboxed
from sandbox_processes import live_processes

PROJECT_ROOT = Path(__file__).resolve().parents[1]
ADD = "def add(a, b):\n    return a + b\n"
WRONG_ADD = "def add(a, b):\n    return a - b\n"


@pytest.fixture(scope="module")
def isolation() -> str:
    """What the sandbox applies on this machine (as root in our containers: everything)."""
    return run_sandboxed("", timeout=5).isolation


def _require(isolation: str, *parts: str) -> None:
    """Skip a guarantee this machine's sandbox cannot give (docs/SANDBOX.md, the fallbacks)."""
    missing = [part for part in parts if part not in isolation]
    if missing:
        pytest.skip(f"needs {missing}; this machine's sandbox applied: {isolation}")


def test_sandbox_reports_what_applied(contained):
    result = run_sandboxed("print('hello')", timeout=5)
    assert (result.exit_code, result.timed_out, result.stdout) == (0, False, "hello\n")
    print("isolation:", result.isolation)  # recorded in docs/SANDBOX.md
    [runner] = contained
    # Everything of docs/SANDBOX.md's "What applies", and no "; notes:" naming a fallback: a machine
    # without namespaces (Docker's default seccomp profile) fails here on purpose, since the tests
    # that need them skip there. The user running the suite picks the one documented difference:
    # root drops the program to the run's own uid; anyone else gets a user namespace instead (only
    # their own uid is mapped into it, so there is no uid to drop to).
    if os.geteuid() == 0:
        user_namespace, uid_drop = [], [f"uid={SANDBOX_UID_BASE + runner}"]
    else:
        user_namespace, uid_drop = ["userns"], []
    # The runner hides /root, the user's own home, /run and /var/run, each where it is a folder
    # (once: /var/run is usually a link to /run), in sorted order. The seccomp filter comes last,
    # installed just before the program starts.
    candidates = {"/root", pwd.getpwuid(os.getuid()).pw_dir, "/run", "/var/run"}
    hidden = sorted({os.path.realpath(path) for path in candidates if os.path.isdir(path)})
    applied = [
        *user_namespace,
        "mountns",
        "netns",
        "pidns",
        "ipcns",
        "readonly-root",
        "fresh-tmpfs",
        *(f"hidden:{folder}" for folder in hidden),
        *uid_drop,
        "rlimits",
        "seccomp",
    ]
    assert result.isolation == ",".join(applied)


def test_correct_solution_scores_one_and_wrong_zero(contained):
    tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"
    completions = [f"Here:\n```python\n{ADD}```", f"```python\n{WRONG_ADD}```"]
    assert code_execution(["p", "p"], completions, tests=[tests, tests]) == [1.0, 0.0]


def test_partial_pass_rate_with_a_list_of_tests(contained):
    # add(a, b) = a - b passes add(2, 0) == 2 and add(0, 0) == 0 but not add(2, 3) == 5: 2 of 3
    tests = ["assert add(2, 0) == 2", "assert add(0, 0) == 0", "assert add(2, 3) == 5"]
    [reward] = code_execution(["p"], [WRONG_ADD], tests=[tests])
    assert reward == pytest.approx(2 / 3)


def test_extract_code_takes_the_last_python_block_or_the_whole_text():
    text = "```python\nx = 1\n```\nthen\n```bash\nls\n```\nfinally\n```py\nx = 2\n```\ndone"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("first ```\nx = 3\n``` and") == "x = 3\n"  # a bare fence counts
    assert extract_code("x = 4") == "x = 4"  # no block: the whole text
    assert extract_code("```python\nx = 5\n") == "x = 5\n"  # cut off before the closing fence


def test_empty_tests_have_no_opinion():
    assert code_execution(["p"] * 3, [ADD] * 3, tests=[None, "", []]) == [None, None, None]


def test_syntax_error_scores_zero(contained):
    assert code_execution(["p"], ["def add(a, b) return a + b"], tests=["assert True"]) == [0.0]


def test_early_exit_does_not_pass_the_tests(contained):
    cheats = ["import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n"]
    assert code_execution(["p"] * 2, cheats, tests=["assert False"] * 2) == [0.0, 0.0]


def test_parallel_workers_match_one_worker(contained):
    completions = [ADD, WRONG_ADD, "def add(a, b) oops", ADD]
    tests = ["assert add(1, 1) == 2", ["assert add(1, 0) == 1", "assert add(1, 1) == 2"], "assert add(1, 1) == 2", None]
    sequential = code_execution(["p"] * 4, completions, tests=tests, workers=1)
    assert sequential == [1.0, 0.5, 0.0, None]
    assert code_execution(["p"] * 4, completions, tests=tests, workers=4) == sequential


def test_infinite_loop_times_out_with_the_penalty(contained):
    started = time.monotonic()
    rewards = code_execution(
        ["p"] * 3,
        ["while True:\n    pass\n", "import time\ntime.sleep(60)", ADD + "while True: pass\n"],
        tests=["assert True", ["pass", "pass"], ["pass"]],
        timeout=1.0,
        timeout_penalty=-0.1,
    )
    assert rewards == [-0.1, -0.1, -0.1]
    # 4 runs of 1 s on 4 workers, plus start-up: far below the 60 s sleep, under any load
    assert time.monotonic() - started < 15


def test_timeout_in_some_of_a_list_counts_as_failed(contained):
    # 1 of 3 snippets loops forever: 2 passed / 3, not the penalty
    tests = ["assert add(1, 1) == 2", "while True: pass", "assert add(0, 0) == 0"]
    [reward] = code_execution(["p"], [ADD], tests=[tests], timeout=1.0)
    assert reward == pytest.approx(2 / 3)


def test_fork_bomb_is_contained(contained, isolation):
    if "uid=" not in isolation:  # RLIMIT_NPROC binds a dropped uid or a user namespace only
        _require(isolation, "userns")
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = run_sandboxed(bomb, timeout=1.5)
    assert result.timed_out or result.exit_code != 0
    # The `contained` fixture then checks no process of the run is left.


def test_memory_bomb_fails_inside_the_child(contained):
    result = run_sandboxed("data = bytearray(2 * 1024**3)\nprint('allocated')", timeout=5)
    assert result.exit_code != 0 and "allocated" not in result.stdout
    assert "MemoryError" in result.stderr
    assert code_execution(["p"], ["data = bytearray(2 * 1024**3)"], tests=["pass"]) == [0.0]


def test_writes_outside_the_temp_dir_do_not_survive(contained, isolation):
    _require(isolation, "mountns", "fresh-tmpfs")
    name = f"grpo-sandbox-escape-{uuid.uuid4().hex}"
    targets = [Path("/tmp") / name, Path("/var/tmp") / name, PROJECT_ROOT / name]
    program = "".join(
        f"try:\n    open({str(t)!r}, 'w').write('x')\nexcept OSError as e:\n    print('blocked', e)\n" for t in targets
    )
    result = run_sandboxed(program, timeout=5)
    assert result.exit_code == 0
    assert [t for t in targets if t.exists()] == []


def test_environment_secrets_are_not_visible(contained, monkeypatch, isolation):
    if "uid=" not in isolation:  # same uid: /proc/<trainer>/environ is readable without pidns
        _require(isolation, "pidns", "mountns")
    monkeypatch.setenv("GRPO_TEST_SECRET", "s3cret")
    # Its own environment, and every other process's it can read through /proc.
    program = (
        "import os\nprint(dict(os.environ))\n"
        "for pid in os.listdir('/proc'):\n"
        "    try:\n        print(open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except OSError:\n        pass\n"
    )
    result = run_sandboxed(program, timeout=5)
    assert result.exit_code == 0 and "PATH" in result.stdout
    assert "s3cret" not in result.stdout + result.stdout_tail


@pytest.mark.parametrize("use_namespaces", [True, False])
def test_network_is_unreachable(contained, use_namespaces):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.3)
    port = listener.getsockname()[1]
    program = (
        f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), 2)\n"
        f"    print('connected')\nexcept OSError as error:\n    print('blocked', error)\n"
    )
    try:
        result = run_sandboxed(program, timeout=5, use_namespaces=use_namespaces)
        assert result.stdout.startswith("blocked"), result.stdout + result.stderr
        with pytest.raises(socket.timeout):
            listener.accept()  # the listener got no connection
    finally:
        listener.close()


@pytest.mark.parametrize("use_namespaces", [True, False])
@pytest.mark.parametrize(
    "attack", ["os.kill(os.getppid(), signal.SIGKILL)", "os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)"]
)
def test_killing_its_parent_leaves_the_trainer_alive(contained, attack, use_namespaces):
    code = f"import os, signal\n{attack}\n"
    result = run_sandboxed(code, timeout=5, use_namespaces=use_namespaces)
    assert result.exit_code != 0
    [reward] = code_execution(["p"], [code], tests=["assert True"])
    assert reward == 0.0
    os.kill(os.getpid(), 0)  # still here (had it been killed, nothing would run at all)


def test_printing_100_mb_is_truncated(contained):
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    started = time.monotonic()
    result = run_sandboxed(
        "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 2**20)", timeout=10, max_output_bytes=64_000
    )
    assert time.monotonic() - started < 10
    assert result.truncated and len(result.stdout) == 64_000
    peak_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert peak_after - peak_before < 50 * 1024  # far from buffering 100 MB


@pytest.mark.parametrize("new_session", [True, False])
def test_no_grandchild_survives(contained, new_session, isolation):
    if new_session and "uid=" not in isolation:  # escapes the process group; found by uid or pidns
        _require(isolation, "pidns")
    seconds = f"{1000 + os.getpid() % 1000}.{uuid.uuid4().int % 10**6}"  # unique to this test
    code = (
        f"import subprocess\nsubprocess.Popen(['sleep', '{seconds}'], "
        f"start_new_session={new_session})\nprint('spawned')\n"
    )
    result = run_sandboxed(code, timeout=5)
    assert result.stdout == "spawned\n"
    assert [pid for pid, info in live_processes().items() if f"sleep {seconds}" in info[2]] == []


def test_fallback_without_namespaces_still_kills_its_process_group(contained):
    seconds = f"{2000 + os.getpid() % 1000}.{uuid.uuid4().int % 10**6}"
    code = f"import subprocess\nsubprocess.Popen(['sleep', '{seconds}'])\nprint('spawned')\n"
    result = run_sandboxed(code, timeout=5, use_namespaces=False)
    assert result.stdout == "spawned\n" and "socket-module-blocked" in result.isolation
    assert [pid for pid, info in live_processes().items() if f"sleep {seconds}" in info[2]] == []


def test_timeout_kills_a_program_that_ignores_sigterm(contained):
    # The runner's own group is killed at the timeout even while the program ignores SIGTERM.
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n"
    result = run_sandboxed(code, timeout=1.0)
    assert result.timed_out and result.exit_code is None  # the fixture: nothing is left


# The seccomp filter (rewards/seccomp.py) and the hidden /run: each test provokes the call for real
# and fails when the filter is not installed (the call succeeds, or fails with another error).

UNIX_CONNECT_BY_SOCKET_MODULE = """\
import errno, socket
try:
    socket.socket(socket.AF_UNIX).connect({path!r})
    print('connected')
except OSError as error:
    print(errno.errorcode[error.errno])
"""
# Without namespaces the runner replaces socket.socket in the program: ctypes goes around that.
UNIX_CONNECT_BY_CTYPES = """\
import ctypes, errno, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.socket(1, 1, 0)  # AF_UNIX, SOCK_STREAM
address = struct.pack('=H', 1) + {path!r}.encode() + b'\\0'  # struct sockaddr_un
if fd < 0 or libc.connect(fd, address, len(address)) != 0:
    print(errno.errorcode[ctypes.get_errno()])
else:
    print('connected')
"""


@pytest.fixture
def host_unix_listener():
    """A listening AF_UNIX socket, mode 777, at a host path the sandbox sees through its read-only
    root (not under /tmp, /dev/shm, /run or a home folder, which it replaces): yields its path."""
    folder = PROJECT_ROOT / ".cache" / "sandbox-sockets"
    folder.mkdir(parents=True, exist_ok=True)
    if any(str(folder).startswith(hidden + os.sep) for hidden in ("/tmp", "/root", "/run")):
        pytest.skip(f"{folder} is hidden inside the sandbox: no host path to test with")
    for parent in [folder, *folder.parents]:
        if parent == folder:
            os.chmod(parent, 0o711)
        elif not parent.stat().st_mode & 0o001:
            pytest.skip(f"the sandbox uid cannot traverse {parent}")
    path = folder / f"grpo-test-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    os.chmod(path, 0o777)
    listener.listen(1)
    listener.settimeout(0.2)
    try:
        yield listener, str(path)
    finally:
        listener.close()
        path.unlink(missing_ok=True)


def _seccomp_expected() -> None:
    if os.uname().machine != "x86_64":
        pytest.skip("the seccomp filter is x86_64 only")


@pytest.mark.parametrize("use_namespaces", [True, False])
def test_host_unix_socket_is_unreachable(host_unix_listener, contained, use_namespaces):
    # The listener first: where it skips (a checkout under /tmp), `contained` is never set up.
    _seccomp_expected()
    listener, path = host_unix_listener
    program = UNIX_CONNECT_BY_SOCKET_MODULE if use_namespaces else UNIX_CONNECT_BY_CTYPES
    result = run_sandboxed(program.format(path=path), timeout=5, use_namespaces=use_namespaces)
    assert result.stdout == "EPERM\n", result.stdout + result.stderr  # socket() itself is denied
    with pytest.raises(socket.timeout):
        listener.accept()  # the listener got no connection


def test_run_is_hidden(contained, isolation):
    _require(isolation, "mountns")
    if not os.access("/run/lock", os.W_OK | os.X_OK):
        pytest.skip("no writable /run/lock to put a host socket in")
    path = f"/run/lock/grpo-test-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(path)
        program = f"import os\nprint(os.path.exists({path!r}), os.listdir('/run'))\n"
        result = run_sandboxed(program, timeout=5)
        assert result.stdout == "False []\n", result.stdout + result.stderr
    finally:
        listener.close()
        os.unlink(path)


CLONE_NEWUSER, SIGCHLD = 0x10000000, 17
# Each succeeds for the dropped uid without the filter (clone and clone3 as a fork, whose child
# prints too). clone3's arguments: struct clone_args (linux/sched.h), 11 u64s, flags first and
# exit_signal fifth.
NAMESPACE_ATTACKS = {
    "unshare": ("libc.unshare(0x10000000)", "EPERM"),
    "clone": (f"libc.syscall(56, {CLONE_NEWUSER | SIGCHLD}, 0, 0, 0, 0)", "EPERM"),
    "clone3": (
        f"libc.syscall(435, struct.pack('=11Q', {CLONE_NEWUSER}, 0, 0, 0, {SIGCHLD}, *[0] * 6), 88)",
        "ENOSYS",
    ),  # ENOSYS: glibc then falls back to clone
    "ptrace": ("libc.ptrace(0, 0, 0, 0)", "EPERM"),  # PTRACE_TRACEME
}


@pytest.mark.parametrize("attack", list(NAMESPACE_ATTACKS))
def test_namespace_and_ptrace_calls_are_denied(contained, attack):
    _seccomp_expected()
    call, expected = NAMESPACE_ATTACKS[attack]
    program = (
        "import ctypes, errno, struct\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"result = {call}\n"
        "print(errno.errorcode[ctypes.get_errno()] if result < 0 else 'succeeded')\n"
    )
    result = run_sandboxed(program, timeout=5)
    assert result.stdout == f"{expected}\n", result.stdout + result.stderr


def test_ordinary_programs_still_work_under_the_filter(contained):
    _seccomp_expected()
    program = (
        "import asyncio, multiprocessing, socket, subprocess, threading\n"
        "print(subprocess.run(['echo', 'x'], capture_output=True, text=True).stdout, end='')\n"
        "thread = threading.Thread(target=print, args=('thread',))\n"
        "thread.start()\nthread.join()\n"
        "with multiprocessing.get_context('fork').Pool(2) as pool:\n"
        "    print(pool.map(abs, [-1, -2]))\n"
        "ours, theirs = multiprocessing.Pipe()  # an AF_UNIX stream socketpair\n"
        "ours.send('pipe')\nprint(theirs.recv())\n"
        "print(asyncio.run(asyncio.sleep(0, 'asyncio')))  # a socketpair for its self-pipe\n"
        "inet = socket.socket()\n"
        "try:\n    inet.connect(('127.0.0.1', 9))\nexcept OSError:\n    print('inet refused')\n"
    )
    result = run_sandboxed(program, timeout=5)
    assert "seccomp" in result.isolation.split(";")[0]
    assert result.stdout == "x\nthread\n[1, 2]\npipe\nasyncio\ninet refused\n", result.stderr


def test_seccomp_is_skipped_with_a_note_off_x86_64(monkeypatch):
    from grpo_cli.rewards import seccomp

    monkeypatch.setattr(seccomp.platform, "machine", lambda: "aarch64")
    # Returns before any prctl: nothing is installed in the test process.
    assert seccomp.install() == "no seccomp: the filter is x86_64 only, this is aarch64"
