"""The trusted half of the sandbox: runs in the child process, isolates it, then runs the program.

Started by `sandbox.run_sandboxed` as

    python -I -S sandbox_runner.py PROGRAM FALLBACK_DIR REPORT_FD TIMEOUT MEMORY_MB FILE_BYTES NPROC UID_BASE USE_NAMESPACES PROGRAM_FDS

and imports nothing from grpo_cli (it must start fast and trust nothing outside the stdlib).
Order: read the program; unshare namespaces (mount, network, pid, ipc; plus user when not root);
make mounts private, the whole tree read-only and nosuid, fresh tmpfs on /tmp, /var/tmp, /dev/shm,
empty tmpfs over the home folders and /run (the host's Unix sockets); fork an init, which mounts
a fresh /proc (it is pid 1 of the new pid namespace) and forks the program's process, which sets
the rlimits, drops to UID_BASE + its pid, installs the seccomp filter (seccomp.py), writes a
one-line JSON report of what applied to REPORT_FD and execs a clean interpreter on the program,
whose argv after its name is PROGRAM_FDS (comma-separated descriptors it inherits: the pipes of
`sandbox.run_connected`; empty for none).
This process waits for it and exits with its exit code (128 + signal when it was killed), so the
user code's parent is the runner's init, never the trainer. Every step is best-effort; what
failed is named in the report.
"""

import ctypes
import importlib.util
import json
import os
import pwd
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE = 442, -100, 0x8000  # 442 on x86_64 and aarch64
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 1, 2
PR_SET_PDEATHSIG = 1
PYTHON_MOUNT = "/tmp/.python"  # where the interpreter is bound inside the fresh /tmp
WORKDIR_IN_NAMESPACE = "/tmp/work"
SOCKET_FOLDERS = ("/run", "/var/run")  # hidden like the home folders (Unix sockets, pid files)

libc = ctypes.CDLL(None, use_errno=True)


class MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    encode = lambda value: value.encode() if isinstance(value, str) else value  # noqa: E731
    _check(libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)), f"mount {target}")


def _unshare(running_as_root: bool) -> tuple[int, list[str]]:
    """The namespace flags that took effect, and notes on what failed."""
    notes = []
    base = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC
    attempts = [base | CLONE_NEWPID, base]
    if not running_as_root:
        attempts = [CLONE_NEWUSER | flags for flags in attempts]
    uid, gid = os.getuid(), os.getgid()
    for flags in attempts:
        if libc.unshare(flags) == 0:
            if flags & CLONE_NEWUSER:  # map ourselves to root inside, to be allowed to mount
                with open("/proc/self/setgroups", "w") as f:
                    f.write("deny")
                with open("/proc/self/uid_map", "w") as f:
                    f.write(f"0 {uid} 1")
                with open("/proc/self/gid_map", "w") as f:
                    f.write(f"0 {gid} 1")
            return flags, notes
        notes.append(f"unshare({flags:#x}) failed: {os.strerror(ctypes.get_errno())}")
    return 0, notes


def _read_only(path: str, applied: list[str], notes: list[str], label: str) -> None:
    attr = MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    if (
        libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr))
        == 0
    ):
        applied.append(label)
    else:
        notes.append(f"mount_setattr read-only {path} failed: {os.strerror(ctypes.get_errno())}")


def _load_seccomp():
    """seccomp.py, beside this file, by its path: `-I` keeps this folder off sys.path."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seccomp.py")
    spec = importlib.util.spec_from_file_location("grpo_sandbox_seccomp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _isolate_filesystem(hidden: set[str], applied: list[str], notes: list[str]) -> str | None:
    """In a fresh mount namespace: the tree read-only, fresh tmpfs, the interpreter bound inside
    /tmp, the `hidden` folders (homes, /run) under empty tmpfs. Returns the interpreter's path
    there, or None when unbound."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount leaks back to the host
    _read_only("/", applied, notes, "readonly-root")
    sizes = {"/tmp": "64m", "/var/tmp": "16m", "/dev/shm": "16m"}
    for target, size in sizes.items():
        if os.path.isdir(target):
            _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},nr_inodes=4096,mode=1777")
    applied.append("fresh-tmpfs")
    # Bind the interpreter into the fresh /tmp: it may live under a home folder the dropped uid
    # cannot traverse (pyenv under /root), and the home folders are hidden next.
    python = None
    prefix = os.path.realpath(sys.base_prefix)
    binary = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    if binary.startswith(prefix + os.sep):
        os.mkdir(PYTHON_MOUNT)
        _mount(prefix, PYTHON_MOUNT, None, MS_BIND | MS_REC)
        _read_only(PYTHON_MOUNT, [], notes, "")
        python = os.path.join(PYTHON_MOUNT, os.path.relpath(binary, prefix))
    for folder in sorted({os.path.realpath(path) for path in hidden}):  # /var/run -> /run: once
        if python is None and (prefix + os.sep).startswith(folder.rstrip(os.sep) + os.sep):
            continue  # the interpreter lives there and could not be moved out of the way
        if folder not in ("/", "") and os.path.isdir(folder):
            try:
                _mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
                applied.append(f"hidden:{folder}")
            except OSError as error:
                notes.append(str(error))
    return python


def _reachable_by_others(path: str) -> bool:
    """Whether a uid that is neither owner nor group can run `path` (every folder o+x)."""
    parts = os.path.realpath(path).split(os.sep)
    for depth in range(1, len(parts)):
        folder = os.sep.join(parts[:depth]) or os.sep
        if not os.stat(folder).st_mode & 0o001:
            return False
    return bool(os.stat(path).st_mode & 0o005 == 0o005)


def _set_limits(timeout: float, memory_mb: int, file_bytes: int, processes: int) -> None:
    cpu_seconds = int(timeout) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


BLOCK_SOCKETS = """\
import socket as _s, _socket
def _blocked(*a, **k):
    raise PermissionError('network access is disabled in the sandbox')
for _m in (_s, _socket):
    for _n in ('socket', 'socketpair', 'create_connection', 'create_server', 'fromfd'):
        if hasattr(_m, _n):
            setattr(_m, _n, _blocked)
del _s, _socket, _m, _n, _blocked
import runpy, sys
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def main() -> None:
    program_path, fallback_dir, report_fd = sys.argv[1], sys.argv[2], int(sys.argv[3])
    timeout, memory_mb = float(sys.argv[4]), int(sys.argv[5])
    file_bytes, processes, sandbox_uid = int(sys.argv[6]), int(sys.argv[7]), int(sys.argv[8])
    use_namespaces = sys.argv[9] == "1"
    program_args = [fd for fd in sys.argv[10].split(",") if fd]
    seccomp = _load_seccomp()  # now: the dropped uid may not be able to read it
    sandbox_uid += os.getpid()  # one uid per run: its own NPROC count, no one else to signal
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the trainer died: so do we
    signal.alarm(int(timeout) + 10)  # a backstop if the trainer's own timeout never fires
    with open(program_path, "rb") as f:
        source = f.read()

    running_as_root = os.geteuid() == 0
    homes = {"/root", pwd.getpwuid(os.getuid()).pw_dir}  # looked up before the uid is remapped
    hidden = homes | set(SOCKET_FOLDERS)
    applied, notes = [], []
    flags, unshare_notes = _unshare(running_as_root) if use_namespaces else (0, ["namespaces off"])
    notes += unshare_notes
    names = {
        CLONE_NEWUSER: "userns",
        CLONE_NEWNS: "mountns",
        CLONE_NEWNET: "netns",
        CLONE_NEWPID: "pidns",
        CLONE_NEWIPC: "ipcns",
    }
    applied += [name for flag, name in names.items() if flags & flag]
    python, workdir = sys.executable, fallback_dir
    if flags & CLONE_NEWNS:
        try:
            python = _isolate_filesystem(hidden, applied, notes) or python
            workdir = WORKDIR_IN_NAMESPACE
        except OSError as error:
            notes.append(f"filesystem isolation failed: {error}")
    drop_uid = running_as_root
    if drop_uid and python == sys.executable and not _reachable_by_others(python):
        drop_uid = False
        notes.append(f"no uid drop: {python} is not reachable by other uids")
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "program.py"), "wb") as f:
        f.write(source)
    if drop_uid:
        os.chown(workdir, sandbox_uid, sandbox_uid)
        os.chmod(workdir, 0o700)
        applied.append(f"uid={sandbox_uid}")
    applied.append("rlimits")
    block_sockets = not flags & CLONE_NEWNET
    if block_sockets:
        applied.append("socket-module-blocked")
    python_home = os.path.dirname(os.path.dirname(python))
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "LD_LIBRARY_PATH": os.path.join(python_home, "lib"),
    }

    # Two more processes: an init (pid 1 of the new pid namespace, still privileged) whose exit
    # makes the kernel kill everything left in the namespace, and the program under it, so that
    # the program has ordinary signal semantics (pid 1 ignores signals it has no handler for).
    def start_program() -> None:
        os.chdir(workdir)
        _set_limits(timeout, memory_mb, file_bytes, processes)
        if drop_uid:
            os.setgroups([])
            os.setgid(sandbox_uid)
            os.setuid(sandbox_uid)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
        # Last, so no set-up step needs what it denies; it holds across execve.
        refused = seccomp.install()
        if refused:
            notes.append(refused)
        else:
            applied.append("seccomp")
        os.write(report_fd, (json.dumps({"applied": applied, "notes": notes}) + "\n").encode())
        os.close(report_fd)
        options = ["-c", BLOCK_SOCKETS] if block_sockets else []
        os.execve(python, [python, "-I", "-B", *options, "program.py", *program_args], env)

    def start_init() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if flags & CLONE_NEWPID and flags & CLONE_NEWNS:
            try:  # our own /proc: the trainer's processes are not even visible
                _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            except OSError:
                pass
        _exit_like(_fork_and_wait(start_program, report_fd))

    _exit_like(_fork_and_wait(start_init, report_fd))


def _fork_and_wait(child, child_only_fd: int) -> int:
    """Run `child()` in a forked process (which must exec or exit); its wait status. The parent
    closes `child_only_fd` (the report pipe): its reader sees the end once the program's process
    wrote the report, or died before it."""
    pid = os.fork()
    if pid == 0:
        try:
            child()
        except BaseException as error:  # noqa: BLE001 - report and leave, never fall through
            os.write(2, f"sandbox runner: cannot start the program: {error!r}\n".encode())
        os._exit(126)
    os.close(child_only_fd)
    return os.waitpid(pid, 0)[1]


def _exit_like(status: int) -> None:
    """Exit with the child's exit code, or 128 + the signal that killed it."""
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


if __name__ == "__main__":
    main()
