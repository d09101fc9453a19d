"""The sandbox's seccomp-BPF filter: the syscalls the model's code may not make (x86_64 only).

`sandbox_runner.py` loads this file by its path (the runner imports nothing from grpo_cli) and
calls `install()` in the program's process after the uid drop, just before it execs the
interpreter on the model's code; the filter then holds for that process and all it starts.
Denied calls fail with an errno, so a program that probes them gets an ordinary OSError:

- socket(AF_UNIX, ...): EPERM. The network namespace does not cover filesystem Unix sockets,
  which the read-only root still exposes (a host listener with mode 777 accepted a connection).
  socketpair(AF_UNIX, ...): EPERM, except SOCK_STREAM pairs: a connected stream pair reaches
  nothing outside (connect and sendto with an address fail), while asyncio's event loop and
  multiprocessing.Pipe() need one. A datagram pair could connect() or sendto() any path.
- unshare, setns, and clone with a CLONE_NEW* flag: EPERM (no nested user namespace, in which
  the dropped uid would be root). clone3 passes its flags in a struct BPF cannot read: ENOSYS,
  on which glibc (threads, posix_spawn) falls back to clone, checked above.
- ptrace, the mount calls (old and new API), pivot_root, chroot, bpf, the key calls,
  perf_event_open, userfaultfd, kexec, modules, reboot, swap: EPERM. io_uring_*: EPERM as well,
  since an io_uring can create and connect sockets without the socket syscall.
- A syscall of another ABI (i386 through int 0x80, x32) kills the process: its numbers differ,
  so the rules above would not apply to it.

Everything else is allowed. Constants are from the kernel's UAPI headers, named where used.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct

# linux/bpf_common.h (classic BPF opcodes)
BPF_LD, BPF_ALU, BPF_JMP, BPF_RET = 0x00, 0x04, 0x05, 0x06
BPF_W, BPF_ABS, BPF_K = 0x00, 0x20, 0x00
BPF_AND, BPF_JEQ, BPF_JGE, BPF_JSET = 0x50, 0x10, 0x30, 0x40

# linux/seccomp.h
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000  # | errno in the low 16 bits (SECCOMP_RET_DATA)
SECCOMP_RET_ALLOW = 0x7FFF0000
# struct seccomp_data { int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]; }
OFFSET_NR, OFFSET_ARCH = 0, 4
OFFSET_ARGS = 16  # args[i] at 16 + 8 * i; its low 32 bits first (little-endian)

# linux/prctl.h
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 38, 22

# linux/audit.h: EM_X86_64 (62, linux/elf-em.h) | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE
AUDIT_ARCH_X86_64 = 62 | 0x80000000 | 0x40000000
X32_SYSCALL_BIT = 0x40000000  # asm/unistd.h: x32 calls have the same arch, nr | this bit

# asm/unistd_64.h
NR_SOCKET, NR_SOCKETPAIR, NR_CLONE, NR_UNSHARE, NR_SETNS, NR_CLONE3 = 41, 53, 56, 272, 308, 435
DENIED_SYSCALLS = {
    "ptrace": 101,
    "pivot_root": 155,
    "chroot": 161,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "init_module": 175,
    "delete_module": 176,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "perf_event_open": 298,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
}

# linux/socket.h, linux/net.h: AF_UNIX; the socket type is the low 4 bits (SOCK_TYPE_MASK),
# above them SOCK_NONBLOCK and SOCK_CLOEXEC
AF_UNIX, SOCK_STREAM, SOCK_TYPE_MASK = 1, 1, 0xF
# linux/sched.h: CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER,
# CLONE_NEWPID, CLONE_NEWNET
CLONE_NEW_ANY = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

DENY = SECCOMP_RET_ERRNO | errno.EPERM
Instruction = tuple[int, int, int, int]  # linux/filter.h, struct sock_filter: code, jt, jf, k


def _statement(code: int, k: int) -> Instruction:
    return (code, 0, 0, k)


def _jump(condition: int, k: int, if_true: int, if_false: int) -> Instruction:
    """Jumps are relative: skip `if_true` or `if_false` instructions after this one."""
    return (BPF_JMP | condition | BPF_K, if_true, if_false, k)


def _load(offset: int) -> Instruction:
    return _statement(BPF_LD | BPF_W | BPF_ABS, offset)


def _return(action: int) -> Instruction:
    return _statement(BPF_RET | BPF_K, action)


def _arch_is_x86_64() -> list[Instruction]:
    return [
        _load(OFFSET_ARCH),
        _jump(BPF_JEQ, AUDIT_ARCH_X86_64, 1, 0),
        _return(SECCOMP_RET_KILL_PROCESS),
        _load(OFFSET_NR),
        _jump(BPF_JGE, X32_SYSCALL_BIT, 0, 1),
        _return(SECCOMP_RET_KILL_PROCESS),
    ]


def _deny(nr: int, action: int = DENY) -> list[Instruction]:
    """nr (already loaded) returns `action`; any other call falls through."""
    return [_jump(BPF_JEQ, nr, 0, 1), _return(action)]


def _deny_unix_socket(nr: int, allow_stream: bool) -> list[Instruction]:
    """socket / socketpair with args[0] == AF_UNIX (an int: its low 32 bits) is denied;
    with `allow_stream`, a SOCK_STREAM type (args[1]) passes. Ends with nr loaded again."""
    stream_passes = (
        [
            _load(OFFSET_ARGS + 8),
            _statement(BPF_ALU | BPF_AND | BPF_K, SOCK_TYPE_MASK),
            _jump(BPF_JEQ, SOCK_STREAM, 1, 0),
        ]
        if allow_stream
        else []
    )
    is_unix = [_load(OFFSET_ARGS), _jump(BPF_JEQ, AF_UNIX, 0, len(stream_passes) + 1)]
    body = [*is_unix, *stream_passes, _return(DENY), _load(OFFSET_NR)]
    return [_jump(BPF_JEQ, nr, 0, len(body) - 1), *body]  # another call: to the reload


def _deny_clone_new_namespace() -> list[Instruction]:
    """clone with any CLONE_NEW* in its flags (args[0]; the kernel reads its low 32 bits)."""
    return [
        _jump(BPF_JEQ, NR_CLONE, 0, 4),
        _load(OFFSET_ARGS),
        _jump(BPF_JSET, CLONE_NEW_ANY, 0, 1),
        _return(DENY),
        _load(OFFSET_NR),
    ]


def build_filter() -> list[Instruction]:
    """The whole program: arch check, then one rule after another, then allow."""
    program = _arch_is_x86_64()  # leaves nr loaded, as every rule does
    program += _deny_unix_socket(NR_SOCKET, allow_stream=False)
    program += _deny_unix_socket(NR_SOCKETPAIR, allow_stream=True)
    program += _deny_clone_new_namespace()
    program += _deny(NR_CLONE3, SECCOMP_RET_ERRNO | errno.ENOSYS)
    for nr in (NR_UNSHARE, NR_SETNS, *DENIED_SYSCALLS.values()):
        program += _deny(nr)
    return program + [_return(SECCOMP_RET_ALLOW)]


class _SockFprog(ctypes.Structure):  # linux/filter.h: struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install() -> str | None:
    """Install the filter in this process (and what it execs); None, or why it was not."""
    if platform.machine() != "x86_64":
        return f"no seccomp: the filter is x86_64 only, this is {platform.machine()}"
    program = build_filter()
    code = b"".join(struct.pack("=HBBI", *instruction) for instruction in program)
    buffer = ctypes.create_string_buffer(code, len(code))
    fprog = _SockFprog(len(program), ctypes.cast(buffer, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    ulong, zero = ctypes.c_ulong, ctypes.c_ulong(0)  # prctl reads unsigned longs
    # No new privileges: required to install a filter without CAP_SYS_ADMIN, and keeps a setuid
    # binary from shedding it.
    if libc.prctl(PR_SET_NO_NEW_PRIVS, ulong(1), zero, zero, zero) != 0:
        return f"no seccomp: PR_SET_NO_NEW_PRIVS failed: {os.strerror(ctypes.get_errno())}"
    if libc.prctl(PR_SET_SECCOMP, ulong(SECCOMP_MODE_FILTER), ctypes.byref(fprog), zero, zero) != 0:
        return f"no seccomp: PR_SET_SECCOMP failed: {os.strerror(ctypes.get_errno())}"
    return None
