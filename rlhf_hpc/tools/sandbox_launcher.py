"""The first process inside the sandbox: copies the program's files into the working directory, sets
the limits, drops to an unprivileged uid where it starts as root, loads the seccomp filter, and
becomes the program (exec).

Run as ``python -I -S sandbox_launcher.py SPEC`` (no site, no environment: only the standard
library), SPEC a JSON object: ``stage`` (a read-only directory holding the files, or null),
``workdir``, ``argv`` (the program's command), ``limits`` (resource name -> value), ``uid`` (or
null), ``seccomp`` (load SECCOMP_DENIED's filter). Stands alone: it imports nothing of the package,
since inside the sandbox there is none. A failure before the program starts exits with
LAUNCH_FAILED and a line naming this launcher.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import shutil
import struct
import sys

__all__ = ["LAUNCH_FAILED", "SECCOMP_ARCHES", "apply_limits", "copy_files", "load_seccomp", "main", "seccomp_filter"]

LAUNCH_FAILED = 125  # as env(1) and docker do for "the command could not be started"

# The allocations no rlimit sees (memory no process's address space holds once its fd or id is
# passed on or dropped) and the way around every mount limit (a user namespace of its own, then a
# tmpfs of any size): memfd_create, memfd_secret, SysV shared memory and message queues, unshare,
# clone with CLONE_NEWUSER. clone3's flags lie in memory a filter cannot read: it answers ENOSYS,
# and the C library falls back to clone (what container runtimes do).
# machine -> (AUDIT_ARCH_*, {syscall: number}); x86_64's x32 numbers (bit 30) are refused whole
SECCOMP_ARCHES = {
    "x86_64": (
        0xC000003E,
        {
            "memfd_create": 319,
            "memfd_secret": 447,
            "shmget": 29,
            "msgget": 68,
            "unshare": 272,
            "clone": 56,
            "clone3": 435,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {
            "memfd_create": 279,
            "memfd_secret": 447,
            "shmget": 194,
            "msgget": 186,
            "unshare": 97,
            "clone": 220,
            "clone3": 435,
        },
    ),
}
SECCOMP_DENIED = ("memfd_create", "memfd_secret", "shmget", "msgget", "unshare")
CLONE_NEWUSER = 0x10000000
X32_BIT = 0x40000000


def seccomp_filter(machine: str) -> bytes:
    """The classic-BPF program (struct sock_filter[]) of the filter for ``machine``: another
    architecture's calls (i386 through int 0x80, x32) and SECCOMP_DENIED get EPERM, clone3 ENOSYS,
    clone with CLONE_NEWUSER EPERM; everything else is allowed."""
    audit_arch, nr = SECCOMP_ARCHES[machine]
    ld_w_abs, jeq_k, jge_k, and_k, ret_k = 0x20, 0x15, 0x35, 0x54, 0x06
    allow, deny, nosys = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    denied = [nr[name] for name in SECCOMP_DENIED]
    # layout: 0 load arch, 1 check it, 2 load nr, 3 x32, 4.. denied, then clone3, clone, allow,
    # the clone flags check, deny, nosys
    n = len(denied)
    at_clone3, at_clone, at_allow = 4 + n, 5 + n, 6 + n
    at_flags, at_deny, at_nosys = at_allow + 1, at_allow + 5, at_allow + 6
    prog = [
        (ld_w_abs, 0, 0, 4),  # A = seccomp_data.arch
        (jeq_k, 0, at_deny - 2, audit_arch),  # another architecture: deny
        (ld_w_abs, 0, 0, 0),
    ]  # A = seccomp_data.nr
    prog.append((jge_k, at_deny - 4, 0, X32_BIT) if machine == "x86_64" else (jeq_k, 0, 0, 0))
    for i, number in enumerate(denied):
        prog.append((jeq_k, at_deny - (5 + i), 0, number))
    prog.append((jeq_k, at_nosys - (at_clone3 + 1), 0, nr["clone3"]))
    prog.append((jeq_k, at_flags - (at_clone + 1), 0, nr["clone"]))
    prog.append((ret_k, 0, 0, allow))
    prog += [
        (ld_w_abs, 0, 0, 16),  # A = low word of args[0] (the flags)
        (and_k, 0, 0, CLONE_NEWUSER),
        (jeq_k, 0, 1, 0),  # no new user namespace: allow
        (ret_k, 0, 0, allow),
        (ret_k, 0, 0, deny),
        (ret_k, 0, 0, nosys),
    ]
    assert len(prog) == at_nosys + 1
    return b"".join(struct.pack("HBBI", *ins) for ins in prog)


def load_seccomp(machine: str) -> None:
    """No new privileges (seccomp's condition without CAP_SYS_ADMIN), then the filter, for this
    process and everything it starts."""
    code = seccomp_filter(machine)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    if libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    prog = SockFprog(len(code) // 8, code)
    if libc.prctl(pr_set_seccomp, seccomp_mode_filter, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def apply_limits(limits: dict[str, int]) -> None:
    """Soft = hard for each ``RLIMIT_<NAME>``, so the program cannot raise them again; CPU gets one
    second between SIGXCPU and SIGKILL."""
    for name, value in limits.items():
        hard = value + 1 if name == "cpu" else value
        resource.setrlimit(getattr(resource, f"RLIMIT_{name.upper()}"), (value, hard))


def copy_files(stage: str) -> None:
    """The stage's files into the working directory, writable by everyone: the program may run
    under another uid than the one copying them, and may change its own files."""
    old = os.umask(0)
    try:
        for root, _, names in os.walk(stage):
            here = os.path.relpath(root, stage)
            os.makedirs(here, mode=0o777, exist_ok=True)
            for name in names:
                fd = os.open(os.path.join(here, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                with open(os.path.join(root, name), "rb") as src, open(fd, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    finally:
        os.umask(old)


def main(argv: list[str]) -> int:
    try:
        spec = json.loads(argv[1])
        os.makedirs(spec["workdir"], exist_ok=True)
        os.chdir(spec["workdir"])
        if spec["stage"]:
            copy_files(spec["stage"])
        apply_limits(spec["limits"])  # as root still: lowering needs no privilege
        if spec["uid"] is not None:
            # a fresh uid owns nothing on the host, and its process count starts at zero, so
            # RLIMIT_NPROC holds (root's never does)
            os.setgroups([])
            os.setgid(spec["uid"])
            os.setuid(spec["uid"])
        if spec.get("seccomp"):
            load_seccomp(os.uname().machine)
        os.execv(spec["argv"][0], spec["argv"])
    except Exception as e:  # anything before exec is the sandbox's failure, not the program's
        sys.stderr.write(f"sandbox launcher: {type(e).__name__}: {e}\n")
        return LAUNCH_FAILED


if __name__ == "__main__":
    sys.exit(main(sys.argv))
