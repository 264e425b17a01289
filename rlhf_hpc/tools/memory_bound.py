"""How the sandbox holds a program to ``sandbox.memory_mb`` in all, whichever way it allocates
(several processes, shared memory, tmpfs): ``memory_bound(cfg, backend) -> MemoryBound``, found once
per process and setting, and ``program_cgroup``, the cgroup of one run.

- **cgroup**: each program runs in a cgroup of its own, made under one this process may write (a
  cgroup v2 with the memory controller delegated to its children, or a cgroup v1 memory hierarchy:
  ``sandbox.cgroup_parent``, else this process's own cgroup or, in v2, its parent). The kernel
  charges every page the program touches, tmpfs and shared memory included, to it.
- **rlimits**, where no such cgroup exists (an ordinary user in a Slurm job, mostly): the limits
  multiply to ``memory_mb``. Each private tmpfs (the working directory, /tmp, /dev/shm) holds
  ``max_file_mb``; what is left is shared by at most ``memory_mb // process_memory_mb`` processes
  and threads of ``process_memory_mb`` address space each; memfd, SysV shared memory and nested
  user namespaces (a tmpfs of any size) are refused by the launcher's seccomp filter.

The seccomp filter is loaded under both bounds where the architecture has one.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rlhf_hpc.config.sandbox_schema import SandboxConfig
from rlhf_hpc.tools.sandbox_launcher import SECCOMP_ARCHES

__all__ = [
    "MEMORY_BOUNDS",
    "MemoryBound",
    "ProgramCgroup",
    "SandboxUnavailable",
    "cgroup_mounts",
    "cgroup_parent",
    "memory_bound",
    "own_cgroups",
    "program_cgroup",
]

MEMORY_BOUNDS = ("auto", "cgroup", "rlimits")
MB = 1024 * 1024
_counter = itertools.count()


class SandboxUnavailable(RuntimeError):
    """No sandbox runs programs on this machine under these settings (the message names why and the fixes)."""


@dataclass(frozen=True)
class CgroupParent:
    """A cgroup programs' cgroups are made in: ``version`` 1 or 2, its directory."""

    version: int
    path: Path


@dataclass(frozen=True)
class MemoryBound:
    """``kind``: cgroup or rlimits; ``parent``: where programs' cgroups are made (cgroup);
    ``process_mb``: each process's address space; ``tasks``: processes and threads at once;
    ``tmpfs``: the private tmpfs mounts of ``max_file_mb`` each counted in the total (rlimits);
    ``seccomp``: the launcher loads the filter (the architecture has one); ``why_no_cgroup``."""

    kind: str
    parent: Optional[CgroupParent]
    process_mb: int
    tasks: int
    tmpfs: int
    seccomp: bool
    why_no_cgroup: str = ""

    def line(self, cfg: SandboxConfig) -> str:
        """What holds a program's memory here, in one line (the dry run's and the first program's)."""
        filt = (
            "memfd, SysV shared memory and nested user namespaces refused (seccomp)"
            if self.seccomp
            else f"no seccomp filter on {os.uname().machine}: memfd and SysV shared memory are not bounded"
        )
        if self.kind == "cgroup":
            return (
                f"memory bound: a cgroup v{self.parent.version} per program under {self.parent.path} "
                f"(sandbox.memory_mb={cfg.memory_mb} MB for all its processes, shared memory and tmpfs); {filt}"
            )
        tmpfs = f" + {self.tmpfs} tmpfs x {cfg.max_file_mb} MB" if self.tmpfs else ""
        why = f"no cgroup here: {self.why_no_cgroup}" if self.why_no_cgroup else "sandbox.memory_bound=rlimits"
        return (
            f"memory bound: rlimits ({why}): {self.tasks} processes or threads x "
            f"{self.process_mb} MB (sandbox.process_memory_mb){tmpfs} <= sandbox.memory_mb={cfg.memory_mb} MB; "
            f"{filt}"
        )


# ------------------------------------------------------------------ finding a cgroup to make programs' cgroups in
def cgroup_mounts() -> dict[int, tuple[Path, str]]:
    """{version: (mount point, the mount's root within the hierarchy)} of the cgroup2 mount and the
    v1 mount holding the memory controller, from /proc/self/mountinfo."""
    found: dict[int, tuple[Path, str]] = {}
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        dash = fields.index("-")
        fstype, options = fields[dash + 1], fields[dash + 3].split(",")
        if fstype == "cgroup2":
            found.setdefault(2, (Path(fields[4]), fields[3]))
        elif fstype == "cgroup" and "memory" in options:
            found.setdefault(1, (Path(fields[4]), fields[3]))
    return found


def own_cgroups() -> dict[int, str]:
    """{version: this process's cgroup path} (v1: in the memory hierarchy), from /proc/self/cgroup."""
    found: dict[int, str] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            found[2] = path
        elif "memory" in controllers.split(","):
            found[1] = path
    return found


def usable(parent: CgroupParent) -> Optional[str]:
    """None when programs' cgroups with a memory limit can be made in ``parent`` by this process,
    else why not."""
    if not parent.path.is_dir():
        return f"{parent.path} is not a cgroup directory"
    if parent.version == 2:
        try:
            delegated = "memory" in (parent.path / "cgroup.subtree_control").read_text().split()
        except OSError as e:
            return f"{parent.path}: {e.strerror}"
        if not delegated:
            return f"{parent.path} does not give its children the memory controller (cgroup.subtree_control)"
    if not os.access(parent.path, os.W_OK) or not os.access(parent.path / "cgroup.procs", os.W_OK):
        return f"{parent.path} is not writable by uid {os.geteuid()}"
    return None


def cgroup_parent(cfg: SandboxConfig) -> tuple[Optional[CgroupParent], str]:
    """(the cgroup programs' cgroups are made in, or None; why none where none): ``sandbox.cgroup_parent``,
    else this process's own cgroup (v2, v1) or its v2 parent, the first where a trial program's cgroup
    takes a limit and a process."""
    if cfg.cgroup_parent:
        path = Path(cfg.cgroup_parent)
        version = 2 if (path / "cgroup.subtree_control").exists() else 1
        candidates = [CgroupParent(version, path)]
    else:
        mounts, own = cgroup_mounts(), own_cgroups()
        candidates = []
        for version in (2, 1):
            if version in mounts and version in own:
                point, root = mounts[version]
                rel = os.path.relpath(own[version], root) if own[version].startswith(root) else None
                if rel is None:
                    continue  # this process's cgroup lies outside the mounted part of the hierarchy
                here = (point / rel).resolve() if rel != "." else point
                candidates.append(CgroupParent(version, here))
                if version == 2 and here != point:
                    candidates.append(CgroupParent(2, here.parent))  # a delegated subtree whose leaf holds us
        if not candidates:
            return None, "no cgroup v2 or v1 memory hierarchy is mounted"
    reasons = []
    for parent in candidates:
        why = usable(parent) or trial(parent)
        if why is None:
            return parent, ""
        reasons.append(why)
    return None, "; ".join(reasons)


def trial(parent: CgroupParent) -> Optional[str]:
    """Make a program's cgroup, give it a limit and a process, remove it: None when all of it works."""
    try:
        with ProgramCgroup(parent, 64, None) as cg:
            out = subprocess.run(cg.wrap(["/bin/sh", "-c", "exit 0"]), capture_output=True, text=True, timeout=30)
            if out.returncode != 0:
                return f"a process cannot join a cgroup under {parent.path}: {out.stderr.strip()[-200:]}"
    except OSError as e:
        return f"{parent.path}: {e.strerror or e}"
    return None


# ------------------------------------------------------------------ one program's cgroup
class ProgramCgroup:
    """The cgroup of one run: made with its limits on entry, every process in it killed and the
    directory removed on exit. ``wrap(argv)`` starts ``argv`` inside it (the shell joins first,
    then execs); ``oom_kills`` counts the processes the kernel killed at the limit."""

    def __init__(self, parent: CgroupParent, memory_mb: int, max_processes: Optional[int]):
        self.parent, self.version = parent, parent.version
        self.path = parent.path / f"rlhf-hpc-sandbox-{os.getpid()}-{next(_counter)}"
        self.memory, self.max_processes = memory_mb * MB, max_processes
        self.oom_kills = 0

    def __enter__(self) -> "ProgramCgroup":
        self.path.mkdir()
        try:
            if self.version == 2:
                self.write("memory.max", self.memory)
                self.write("memory.swap.max", 0, optional=True)
                self.write("memory.oom.group", 1, optional=True)  # one killed, all killed
                if self.max_processes:
                    self.write("pids.max", self.max_processes, optional=True)  # where pids is delegated too
            else:
                self.write("memory.limit_in_bytes", self.memory)
                self.write("memory.memsw.limit_in_bytes", self.memory, optional=True)  # swap too, where counted
        except OSError:
            self.remove()
            raise
        return self

    def write(self, name: str, value: int, optional: bool = False) -> None:
        try:
            (self.path / name).write_text(str(value))
        except FileNotFoundError:
            if not optional:
                raise

    def wrap(self, argv: list[str]) -> list[str]:
        return ["/bin/sh", "-c", 'echo $$ > "$1" && shift && exec "$@"', "sh", str(self.path / "cgroup.procs"), *argv]

    def read_oom_kills(self) -> int:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            fields = dict(line.split() for line in (self.path / name).read_text().splitlines() if line.strip())
        except (OSError, ValueError):
            return 0
        return int(fields.get("oom_kill", 0))

    def kill_all(self, wait_s: float = 5.0) -> bool:
        """SIGKILL to whatever is left in the cgroup until it is empty (or ``wait_s`` passed)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                pids = (self.path / "cgroup.procs").read_text().split()
            except OSError:
                return True
            if not pids:
                return True
            if time.monotonic() > deadline:
                return False
            if self.version == 2 and (self.path / "cgroup.kill").exists():
                (self.path / "cgroup.kill").write_text("1")
            else:
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            time.sleep(0.02)

    def remove(self) -> None:
        for _ in range(100):  # a killed process leaves the cgroup a moment after it dies
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.05)
        _stale.append(self.path)  # tried again after the next run

    def __exit__(self, *exc) -> None:
        self.oom_kills = self.read_oom_kills()
        self.kill_all()
        self.remove()
        for path in list(_stale):
            try:
                path.rmdir()
                _stale.remove(path)
            except OSError:
                pass


_stale: list[Path] = []


def program_cgroup(bound: MemoryBound, cfg: SandboxConfig) -> Optional[ProgramCgroup]:
    """The cgroup one run of ``cfg`` gets under ``bound`` (None under rlimits)."""
    return ProgramCgroup(bound.parent, cfg.memory_mb, cfg.max_processes) if bound.kind == "cgroup" else None


# ------------------------------------------------------------------ the bound in force here
_bounds: dict[tuple, MemoryBound] = {}
_lock = threading.Lock()


def memory_bound(cfg: SandboxConfig, tmpfs: int) -> MemoryBound:
    """The bound programs run under here with ``cfg``, for a backend with ``tmpfs`` private tmpfs
    mounts; raises SandboxUnavailable where ``cfg`` asks for one this machine cannot give, or
    where rlimits cannot hold even one process within memory_mb."""
    key = (
        cfg.memory_bound,
        cfg.cgroup_parent,
        cfg.memory_mb,
        cfg.process_memory_mb,
        cfg.max_processes,
        cfg.max_file_mb,
        tmpfs,
    )
    with _lock:
        if key not in _bounds:
            _bounds[key] = find_bound(cfg, tmpfs)
        return _bounds[key]


def find_bound(cfg: SandboxConfig, tmpfs: int) -> MemoryBound:
    if cfg.memory_bound not in MEMORY_BOUNDS:
        raise SandboxUnavailable(f"sandbox.memory_bound={cfg.memory_bound}: expected one of {', '.join(MEMORY_BOUNDS)}")
    seccomp = os.uname().machine in SECCOMP_ARCHES
    why = ""
    if cfg.memory_bound != "rlimits":
        parent, why = cgroup_parent(cfg)
        if parent is not None:
            return MemoryBound("cgroup", parent, cfg.memory_mb, cfg.max_processes, 0, seccomp)
        if cfg.memory_bound == "cgroup":
            raise SandboxUnavailable(
                f"sandbox.memory_bound=cgroup: no cgroup for programs can be made here ({why}). Fixes: "
                f"sandbox.cgroup_parent=<a cgroup you may write, with the memory controller for its children>, "
                f"or sandbox.memory_bound=auto (rlimits where no cgroup is)"
            )
    room = cfg.memory_mb - tmpfs * cfg.max_file_mb
    tasks = min(cfg.max_processes, room // cfg.process_memory_mb) if room > 0 else 0
    if tasks < 1:
        raise SandboxUnavailable(
            f"sandbox.memory_mb={cfg.memory_mb}: without a cgroup ({why or 'sandbox.memory_bound=rlimits'}) it must "
            f"hold {tmpfs} tmpfs of "
            f"sandbox.max_file_mb={cfg.max_file_mb} and one process of sandbox.process_memory_mb="
            f"{cfg.process_memory_mb}; raise memory_mb to at least {tmpfs * cfg.max_file_mb + cfg.process_memory_mb}, "
            f"or lower process_memory_mb or max_file_mb"
        )
    return MemoryBound("rlimits", None, cfg.process_memory_mb, tasks, tmpfs, seccomp, why)
