"""A small seccomp deny list for sandboxed commands, as the classic-BPF program `bwrap --seccomp FD` loads.

Why hand-written: bubblewrap takes a compiled program, and compiling one usually means libseccomp
plus its Python bindings, which are not on PyPI as a wheel everywhere and would be a new native
dependency. A deny list of a few dozen syscalls is a short, fixed program; this file builds it.

What it denies (EPERM), on top of what the namespaces already stop: changing the mount table or
the root (mount, the new mount API, pivot_root, chroot), entering or creating namespaces (unshare,
setns, clone with a CLONE_NEW* flag; clone3 answers ENOSYS so libc falls back to clone, whose flags
a classic-BPF filter can read), inspecting other processes (ptrace, process_vm_*), and kernel
interfaces no tool call needs (keyrings, bpf, perf events, kexec, modules, open_by_handle_at,
userfaultfd, swap, reboot, syslog, quotactl). Syscalls of another ABI than the native one (32-bit
x86 via int 0x80, x32) are denied whole, so the list cannot be bypassed through their numbers.
Unknown architectures get no filter (`program()` returns None) and the start-up report says so.
"""

from __future__ import annotations

import errno
import os
import platform
import struct

# Classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h).
_LD_ABS_W = 0x20
_JEQ, _JGE, _JSET = 0x15, 0x35, 0x45
_RET = 0x06
_ALLOW = 0x7FFF0000
_ERRNO = 0x00050000
_OFF_NR, _OFF_ARCH, _OFF_ARG0 = 0, 4, 16  # struct seccomp_data (little-endian: arg0's low word)

_NAMESPACE_FLAGS = 0x7E020080  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET|NEWTIME

# Same numbers on every architecture (the unified range from 424 on).
_COMMON = {"open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
           "fspick": 433, "mount_setattr": 442}
# The denied syscalls' numbers on (x86_64, aarch64), in one table so that a syscall is denied on every
# architecture or the table says why not (None: that architecture has no such syscall).
_NUMBERS: dict[str, tuple[int, int | None]] = {
    # the mount table and the root
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    # namespaces (clone: only with CLONE_NEW* flags, see program())
    "unshare": (272, 97), "setns": (308, 268), "clone": (56, 220),
    # other processes
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    # kernel interfaces no tool call needs
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218), "bpf": (321, 280),
    "perf_event_open": (298, 241), "kexec_load": (246, 104), "kexec_file_load": (320, 294),
    "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264), "init_module": (175, 105),
    "finit_module": (313, 273), "delete_module": (176, 106), "userfaultfd": (323, 282), "swapon": (167, 224),
    "swapoff": (168, 225), "reboot": (169, 142), "syslog": (103, 116), "quotactl": (179, 60), "acct": (163, 89),
    "iopl": (172, None), "ioperm": (173, None),  # x86 port I/O
}
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# machine -> (its AUDIT_ARCH value, syscall name -> number)
_ARCHES: dict[str, tuple[int, dict[str, int]]] = {
    machine: (audit, {name: numbers[column] for name, numbers in _NUMBERS.items() if numbers[column] is not None})
    for column, (machine, audit) in enumerate(_AUDIT_ARCH.items())
}
_CLONE3 = 435
_X32_BIT = 0x40000000


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def denied_syscalls(machine: str | None = None) -> list[str]:
    arch = _ARCHES.get(machine or platform.machine())
    if arch is None:
        return []
    return sorted({*arch[1], *_COMMON, "clone3"} - {"clone"}) + ["clone (with CLONE_NEW* flags)"]


def program(machine: str | None = None) -> bytes | None:
    """The filter for this machine's architecture, or None where there is no table for it."""
    arch = _ARCHES.get(machine or platform.machine())
    if arch is None:
        return None
    audit_arch, table = arch
    numbers = {**table, **_COMMON}
    clone_nr = numbers.pop("clone")
    deny = sorted(set(numbers.values()))
    # Layout: [arch check] [nr load] [x32 check] [one JEQ per denied nr] [clone3] [clone] ALLOW,
    # then the three returns the jumps land on: DENY (EPERM), ENOSYS, and the clone flag check.
    body: list[tuple[int, int, str | None]] = [(_JEQ, audit_arch, None)]  # jf -> DENY
    body.append((_LD_ABS_W, _OFF_NR, "load"))
    body.append((_JGE, _X32_BIT, "deny"))
    body += [(_JEQ, nr, "deny") for nr in deny]
    body.append((_JEQ, _CLONE3, "enosys"))
    body.append((_JEQ, clone_nr, "clone"))
    n = len(body)
    labels = {"allow": n, "deny": n + 1, "enosys": n + 2, "clone": n + 3}
    out = [_insn(_LD_ABS_W, _OFF_ARCH)]
    for i, (code, k, target) in enumerate(body, start=1):
        if code == _LD_ABS_W:
            out.append(_insn(code, k))
        elif target is None:  # the arch check: fall through when native, else deny
            out.append(_insn(code, k, 0, labels["deny"] + 1 - i - 1))
        else:
            out.append(_insn(code, k, labels[target] + 1 - i - 1, 0))
    out.append(_insn(_RET, _ALLOW))
    out.append(_insn(_RET, _ERRNO | errno.EPERM))
    out.append(_insn(_RET, _ERRNO | errno.ENOSYS))
    out.append(_insn(_LD_ABS_W, _OFF_ARG0))  # clone: deny namespace flags, allow threads/forks
    out.append(_insn(_JSET, _NAMESPACE_FLAGS, 0, 1))
    out.append(_insn(_RET, _ERRNO | errno.EPERM))
    out.append(_insn(_RET, _ALLOW))
    return b"".join(out)


def program_fd(prog: bytes) -> int:
    """A readable fd holding `prog` (bwrap reads it to EOF); the caller passes it on and closes it."""
    r, w = os.pipe()
    try:
        os.write(w, prog)  # a few hundred bytes: always fits the pipe buffer
    finally:
        os.close(w)
    return r
