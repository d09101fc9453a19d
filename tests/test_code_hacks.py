"""The code reward cannot be fooled: hacks that solve nothing score 0, what real solutions and
tests do still scores 1 (docs/SANDBOX.md, "Two processes").

Every hack below scored 1.0 when the model's code and its tests ran as one program (issue 18,
item 2); each now scores 0.0 because the tests run in a process of their own, which the model's
code cannot read, patch or signal, and what crosses between the two is plain values only.
"""

from __future__ import annotations

import tempfile

import pytest

from grpo_cli.rewards.code import REMOTE_CALL_SOURCE, code_execution
from grpo_cli.rewards.sandbox import run_connected, run_sandboxed

ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
TYPE_TESTS = "assert isinstance(add(2, 3), int)\n"  # weak on purpose: what a patch would beat
FRAME_TESTS = "expected = 5\nassert add(2, 3) == expected\n"
MAP_TESTS = "assert all(map(lambda case: add(*case[0]) == case[1], [((2, 3), 5), ((1, 1), 2)]))\n"

FORGED_FIRST_MESSAGE = """\
import json, os, sys
reads, writes = (os.fdopen(int(fd), mode) for fd, mode in zip(sys.argv[1:3], ("rb", "wb")))
def send(message):
    writes.write(json.dumps(message).encode() + b"\\n")
    writes.flush()
send({"names": {"add": {"handle": [0, "f"]}, "__builtins__": {"dict": [
    ["isinstance", {"handle": [1, "f"]}], ["int", 0]]}}})
for line in reads:  # add() answers "five", isinstance() answers True
    send({"value": "five" if json.loads(line)["target"]["handle"][0] == 0 else True})
os._exit(0)
"""

# hack -> (the completion's code, the tests it beat when both ran as one program, or, for the
# forged first message, the first version of the two-process design)
HACKS = {
    # Reads the end marker from the program's own source, prints it and exits 0.
    "marker from __file__": (
        "import re, sys\nsource = open(__file__).read()\n"
        "print(re.findall(r'__grpo_tests_done_[0-9a-f]+__', source)[-1])\nsys.exit(0)\n",
        ADD_TESTS,
    ),
    # The same through the hooks that run after a failing test.
    "marker in excepthook": (
        "import os, re, sys\nmarker = re.findall(r'__grpo_tests_done_[0-9a-f]+__', "
        "open(__file__).read())[-1]\n"
        "def hook(*args):\n    print(marker, flush=True)\n    os._exit(0)\n"
        "sys.excepthook = hook\ndef add(a, b):\n    return 0\n",
        ADD_TESTS,
    ),
    "marker at exit": (
        "import atexit, os, re\nmarker = re.findall(r'__grpo_tests_done_[0-9a-f]+__', "
        "open(__file__).read())[-1]\n"
        "atexit.register(lambda: (print(marker, flush=True), os._exit(0)))\n"
        "def add(a, b):\n    raise SystemExit(0)\n",
        ADD_TESTS,
    ),
    # An object equal to everything, and an int whose == always holds.
    "always-equal object": (
        "class Anything:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Anything()\n",
        ADD_TESTS,
    ),
    "always-equal int": (
        "class Equal(int):\n    def __eq__(self, other):\n        return True\n"
        "    __hash__ = int.__hash__\n"
        "def add(a, b):\n    return Equal(0)\n",
        ADD_TESTS + TYPE_TESTS,
    ),
    # Patches the builtins the tests use, or shadows them with its own.
    "patched isinstance": (
        "import builtins\nbuiltins.isinstance = lambda *args: True\ndef add(a, b):\n    return 'five'\n",
        TYPE_TESTS,
    ),
    "shadowed isinstance": ("def isinstance(*args):\n    return True\ndef add(a, b):\n    return 'five'\n", TYPE_TESTS),
    # Reads the expected value out of the caller's frame.
    "caller's frame": ("import sys\ndef add(a, b):\n    return sys._getframe(1).f_locals['expected']\n", FRAME_TESTS),
    # Raises StopIteration: a map() in the tests ends early, and all() of nothing holds.
    "StopIteration ends a map": ("def add(a, b):\n    raise StopIteration\n", MAP_TESTS),
    # Speaks the wire itself: a first message of its own that hands the tests `__builtins__`
    # (found by a review of the two-process design; it beat the first version of it).
    "forged first message": (FORGED_FIRST_MESSAGE, TYPE_TESTS),
}


@pytest.mark.parametrize("hack", list(HACKS))
def test_a_hack_that_solves_nothing_scores_zero(contained, hack):
    code, tests = HACKS[hack]
    [reward] = code_execution(["p"], [code], tests=[tests], timeout=5.0)
    assert reward == 0.0


def test_the_tests_of_each_hack_pass_a_real_solution(contained):
    # The control: each hack's tests are passable, so its 0.0 above is the hack's failure.
    tests = sorted({tests for _, tests in HACKS.values()})
    rewards = code_execution(["p"] * len(tests), ["def add(a, b):\n    return a + b\n"] * len(tests), tests=tests)
    assert rewards == [1.0] * len(tests)


def test_killing_every_process_it_can_reach_does_not_touch_the_tests(contained):
    # Every pid it sees, and kill(-1): its own pid namespace and uid hold nothing of the tests'.
    # Without both (a fallback, docs/SANDBOX.md) it would have the trainer's uid and kill this
    # very test run: asked only where the solution's run had one of them.
    isolation = run_sandboxed("", timeout=5).isolation
    if "pidns" not in isolation and "uid=" not in isolation:
        pytest.skip(f"neither a pid namespace nor a uid of its own here: {isolation}")
    code = (
        "import os, signal\n"
        "for pid in [int(p) for p in os.listdir('/proc') if p.isdigit()] + [-1]:\n"
        "    if pid != os.getpid():\n"
        "        try:\n            os.kill(pid, signal.SIGKILL)\n"
        "        except OSError:\n            pass\n"
        "def add(a, b):\n    return a + b\n"
    )
    assert code_execution(["p"], [code], tests=[ADD_TESTS]) == [1.0]


SEARCH_FOR_SECRET = r"""
import glob, os, sys
secret = bytes.fromhex({secret_hex!r})
found = []
paths = glob.glob('/tmp/**', recursive=True) + glob.glob('/var/tmp/**', recursive=True)
paths += glob.glob({trainer_temp!r} + '/**', recursive=True)
paths += glob.glob('/proc/*/cmdline') + glob.glob('/proc/*/environ') + glob.glob('/proc/*/fd/*')
for path in paths:
    try:
        with open(path, 'rb') as f:
            if secret in f.read(1 << 22):
                found.append(path)
    except OSError:
        pass
print('found' if found else 'not found', found)
"""


@pytest.mark.parametrize("use_namespaces", [True, False])
@pytest.mark.parametrize("side", ["tests", "solution"])
def test_the_solution_cannot_read_the_tests_source(contained, tmp_path, side, use_namespaces):
    # The first program searches every file it may read (both /tmps, the trainer's temporary
    # folder, /proc) for a secret. With the secret in the tests' program it finds nothing; the
    # control puts it in the searching program's own file, which it does find. Without
    # namespaces (a fallback, docs/SANDBOX.md) the two runs' uids and the files' modes hold it.

    secret = "the-tests-secret-" + tmp_path.name
    search = SEARCH_FOR_SECRET.format(secret_hex=secret.encode().hex(), trainer_temp=tempfile.gettempdir())
    tests = (
        f"import sys\nSECRET = {secret!r}\n"
        f"sys.stdin = open(int(sys.argv[1]), 'rb')\nsys.stdin.read()\n"
    )  # until it ends
    if not use_namespaces:  # asked first: the search through a host /tmp takes seconds
        isolation = run_sandboxed("", timeout=5, use_namespaces=False).isolation
        if "uid=" not in isolation:
            pytest.skip(f"no uid drop here, so no separation without namespaces: {isolation}")
    if side == "solution":
        search += f"# {secret}\n"
    solution, _ = run_connected(search, tests, timeout=10, use_namespaces=use_namespaces)
    expected = "not found" if side == "tests" else "found"
    assert solution.stdout.split(" [")[0] == expected, solution.stdout + solution.stderr


REAL_SOLUTIONS = {
    "types": (
        "import collections\nPoint = collections.namedtuple('Point', 'x y')\n"
        "def f():\n    return (1, 2.5), {1: 'a'}, {3}, b'x', None, 1j, float('nan')\n"
        "def point():\n    return Point(1, 2)\n",
        "t, d, s, b, n, c, nan = f()\n"
        "assert t == (1, 2.5) and type(t) is tuple and d == {1: 'a'} and s == {3}\n"
        "assert b == b'x' and n is None and c == 1j and nan != nan\n"
        "assert point() == (1, 2)\n",
    ),
    "keyword arguments and defaults": (
        "def f(a, b=2, *, c=3):\n    return a + b + c\n",
        "assert f(1) == 6 and f(1, c=10, b=0) == 11\n",
    ),
    "an expected exception": (
        "def root(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x ** 0.5\n",
        "try:\n    root(-1)\nexcept ValueError as e:\n"
        "    assert 'negative' in str(e)\nelse:\n    raise AssertionError\n"
        "assert root(4) == 2.0\n",
    ),
    "a class with methods": (
        "class Solution:\n    offset = 1\n"
        "    def two_sum(self, nums, target):\n"
        "        seen = {}\n        for i, n in enumerate(nums):\n"
        "            if target - n in seen:\n"
        "                return [seen[target - n], i]\n"
        "            seen[n] = i\n",
        "s = Solution()\nassert s.two_sum([2, 7, 11], 9) == [0, 1]\nassert Solution.offset == 1 and s.offset == 1\n",
    ),
    "a generator": (
        "def evens(n):\n    yield from range(0, n, 2)\n",
        "assert list(evens(5)) == [0, 2, 4]\nassert 2 in list(evens(3))\n",
    ),
    "module constants": ("LIMIT = 10\nTABLE = {'a': (1, 2)}\n", "assert LIMIT == 10 and TABLE['a'] == (1, 2)\n"),
    "HumanEval's check(candidate)": (
        "def add(a, b):\n    return a + b\n",
        "def check(candidate):\n    assert candidate(1, 2) == 3\ncheck(add)\n",
    ),
    "a function handed back": (
        "def twice(f, x):\n    return f(f(x))\ndef inc(x):\n    return x + 1\n",
        "assert twice(inc, 1) == 3\n",
    ),
    "numpy values": (
        "import numpy as np\ndef mean(xs):\n    return np.mean(xs)\ndef arr():\n    return np.arange(3)\n",
        "assert mean([1, 2, 3]) == 2.0 and type(mean([1])) is float\nassert arr() == [0, 1, 2]\n",
    ),
    "a main block and prints": (
        "def f():\n    print('working')\n    return 1\nif __name__ == '__main__':\n    print(f())\n",
        "import math\nprint('checking', f())\nassert math.isclose(f(), 1)\n",
    ),
}


def test_real_solutions_and_tests_still_pass(contained):
    cases = dict(REAL_SOLUTIONS)
    # The sandbox runs the base interpreter (the venv's site-packages are not its): numpy only
    # where that interpreter has it.
    if run_sandboxed("import numpy", timeout=10).exit_code != 0:
        del cases["numpy values"]
    codes, tests = zip(*cases.values())
    rewards = code_execution(["p"] * len(codes), [f"```python\n{c}```" for c in codes], tests=list(tests))
    assert dict(zip(cases, rewards)) == dict.fromkeys(cases, 1.0)


# What the two processes cannot do (docs/SANDBOX.md, "Two processes"): the tests see what the
# solution returns, not what it does to their arguments, and they cannot send it their objects.
LIMITS = {
    "in-place changes to an argument": (
        "def sort_in_place(xs):\n    xs.sort()\n",
        "xs = [3, 1]\nsort_in_place(xs)\nassert xs == [1, 3]\n",
    ),
    "an object of the tests'": ("def apply(f, x):\n    return f(x)\n", "assert apply(lambda x: x + 1, 1) == 2\n"),
    "the solution's == on its objects": (
        "class P:\n    def __init__(self, x):\n        self.x = x\n"
        "    def __eq__(self, other):\n        return self.x == other.x\n"
        "def make(x):\n    return P(x)\n",
        "assert make(1) == make(1)\n",
    ),
}


def test_what_does_not_cross_fails_as_documented(contained):
    codes, tests = zip(*LIMITS.values())
    rewards = code_execution(["p"] * len(codes), list(codes), tests=list(tests))
    assert dict(zip(LIMITS, rewards)) == dict.fromkeys(LIMITS, 0.0)


def test_the_wire_source_is_stdlib_only():
    # It is copied into programs whose interpreter cannot import grpo_cli (-I, another uid).
    imports = [line for line in REMOTE_CALL_SOURCE.splitlines() if line.startswith(("import ", "from "))]
    assert imports and all(
        line.split()[1] in {"builtins", "json", "keyword", "math", "os", "sys", "traceback", "types"}
        for line in imports
    )


def test_a_solution_that_hangs_in_a_call_times_out_with_the_penalty(contained):
    # The tests wait on the call until their own deadline: a timeout (-0.1), never a closed pipe
    # from the solution's deadline coming first (which would read as a failed test, 0.0).
    hangs = "def add(a, b):\n    while True:\n        pass\n"
    rewards = code_execution(["p"] * 2, [hangs] * 2, tests=[ADD_TESTS] * 2, timeout=1.0, timeout_penalty=-0.1)
    assert rewards == [-0.1, -0.1]
