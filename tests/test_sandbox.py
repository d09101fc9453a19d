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
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from grpo_cli.rewards import sandbox
from grpo_cli.rewards.code import code_execution, extract_code
from grpo_cli.rewards.sandbox import SANDBOX_UID_BASE, run_sandboxed

PROJECT_ROOT = Path(__file__).resolve().parents[1]
ADD = "def add(a, b):\n    return a + b\n"
WRONG_ADD = "def add(a, b):\n    return a - b\n"


def _processes() -> dict[int, tuple[int, int, str]]:
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
    leaked = {pid: info for pid, info in _processes().items()
              if info[0] in uids or info[1] in runners}
    assert not leaked, f"processes left behind: {leaked}"
    assert list(sandboxes.iterdir()) == [], "a temporary folder was left behind"


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
    # The runner hides /root and the user's own home, each where it is a folder, in sorted order.
    homes = sorted(home for home in {"/root", pwd.getpwuid(os.getuid()).pw_dir} if os.path.isdir(home))
    applied = [*user_namespace, "mountns", "netns", "pidns", "ipcns", "readonly-root", "fresh-tmpfs",
               *(f"hidden:{home}" for home in homes), *uid_drop, "rlimits"]
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
    tests = ["assert add(1, 1) == 2", ["assert add(1, 0) == 1", "assert add(1, 1) == 2"],
             "assert add(1, 1) == 2", None]
    sequential = code_execution(["p"] * 4, completions, tests=tests, workers=1)
    assert sequential == [1.0, 0.5, 0.0, None]
    assert code_execution(["p"] * 4, completions, tests=tests, workers=4) == sequential


def test_infinite_loop_times_out_with_the_penalty(contained):
    started = time.monotonic()
    rewards = code_execution(["p"] * 3, ["while True:\n    pass\n", "import time\ntime.sleep(60)",
                                         ADD + "while True: pass\n"],
                             tests=["assert True", ["pass", "pass"], ["pass"]], timeout=1.0,
                             timeout_penalty=-0.1)
    assert rewards == [-0.1, -0.1, -0.1]
    assert time.monotonic() - started < 6  # 4 runs of 1 s on 4 workers, plus start-up


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
    program = "".join(f"try:\n    open({str(t)!r}, 'w').write('x')\nexcept OSError as e:\n"
                      f"    print('blocked', e)\n" for t in targets)
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
    program = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), 2)\n"
               f"    print('connected')\nexcept OSError as error:\n    print('blocked', error)\n")
    try:
        result = run_sandboxed(program, timeout=5, use_namespaces=use_namespaces)
        assert result.stdout.startswith("blocked"), result.stdout + result.stderr
        with pytest.raises(socket.timeout):
            listener.accept()  # the listener got no connection
    finally:
        listener.close()


@pytest.mark.parametrize("use_namespaces", [True, False])
@pytest.mark.parametrize("attack", ["os.kill(os.getppid(), signal.SIGKILL)",
                                    "os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)"])
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
    result = run_sandboxed("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 2**20)",
                           timeout=10, max_output_bytes=64_000)
    assert time.monotonic() - started < 10
    assert result.truncated and len(result.stdout) == 64_000
    peak_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert peak_after - peak_before < 50 * 1024  # far from buffering 100 MB


@pytest.mark.parametrize("new_session", [True, False])
def test_no_grandchild_survives(contained, new_session, isolation):
    if new_session and "uid=" not in isolation:  # escapes the process group; found by uid or pidns
        _require(isolation, "pidns")
    seconds = f"{1000 + os.getpid() % 1000}.{uuid.uuid4().int % 10**6}"  # unique to this test
    code = (f"import subprocess\nsubprocess.Popen(['sleep', '{seconds}'], "
            f"start_new_session={new_session})\nprint('spawned')\n")
    result = run_sandboxed(code, timeout=5)
    assert result.stdout == "spawned\n"
    assert [pid for pid, info in _processes().items() if f"sleep {seconds}" in info[2]] == []


def test_fallback_without_namespaces_still_kills_its_process_group(contained):
    seconds = f"{2000 + os.getpid() % 1000}.{uuid.uuid4().int % 10**6}"
    code = f"import subprocess\nsubprocess.Popen(['sleep', '{seconds}'])\nprint('spawned')\n"
    result = run_sandboxed(code, timeout=5, use_namespaces=False)
    assert result.stdout == "spawned\n" and "socket-module-blocked" in result.isolation
    assert [pid for pid, info in _processes().items() if f"sleep {seconds}" in info[2]] == []


def test_timeout_kills_a_program_that_ignores_sigterm(contained):
    # The runner's own group is killed at the timeout even while the program ignores SIGTERM.
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n"
    result = run_sandboxed(code, timeout=1.0)
    assert result.timed_out and result.exit_code is None  # the fixture: nothing is left
