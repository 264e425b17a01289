"""The keys of running untrusted code: ``sandbox`` (this project's own sandbox on the node,
rlhf_hpc/tools/sandbox.py) and verl's ``reward_model.sandbox_fusion`` (the user's own SandboxFusion
service, called instead when its ``url`` is set). Sections of ``rlhf_hpc.config.schema.Config``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["SandboxConfig", "SandboxFusionConfig"]


@dataclass
class SandboxConfig:
    """Where and under which limits a program runs (the code reward's test cases, the code tool).
    Every limit is per run of one program, all its processes together; the wall-clock limit kills
    its whole process tree."""

    # a name in rlhf_hpc.tools.backends.SANDBOX_BACKENDS (bwrap, apptainer, rlimit), or auto: bwrap
    # where it can create namespaces here, else apptainer (with apptainer_image); never rlimit,
    # which has no namespaces (it sees the files and the network the user sees) and is used only
    # when chosen here by name
    backend: str = "auto"
    timeout_s: float = 10.0  # wall clock (and CPU seconds per process)
    # the program's whole memory: its processes, shared memory and tmpfs together (how it is held
    # here: memory_bound, rlhf_hpc/tools/memory_bound.py)
    memory_mb: int = 1024
    # auto: a cgroup per program where this process may make one (root, a delegated cgroup v2
    # subtree), else rlimits; cgroup: refused where none can be made; rlimits: never a cgroup
    memory_bound: str = "auto"
    # the cgroup programs' cgroups are made in (v2 with the memory controller enabled for its
    # children, or a v1 memory cgroup); null: this process's own cgroup, or in v2 its parent
    cgroup_parent: Optional[str] = None
    # rlimits bound only: each process's address space; the processes and threads a program may have
    # at once are then (memory_mb - the tmpfs mounts) // this, at most max_processes
    process_memory_mb: int = 256
    max_processes: int = 32  # processes and threads at once
    # the largest file written, and each private tmpfs (/tmp, the working directory, /dev/shm)
    max_file_mb: int = 64
    max_output_kb: int = 1024  # per stream (stdout, stderr): beyond it the program is stopped
    # the interpreter programs run with; null: the trainer's own (sys.executable). Its prefix (and
    # its venv's) is mounted read-only inside, even where it lies under $HOME
    python: Optional[str] = None
    max_parallel: int = 4  # programs running at once in one process (a trainer rank)
    # more read-only paths inside (bwrap), e.g. the site's module tree the interpreter's libraries are in
    ro_binds: list[str] = field(default_factory=list)
    # backend apptainer: the image (a .sif with python3) programs run in; python then defaults to python3
    apptainer_image: Optional[str] = None


@dataclass
class SandboxFusionConfig:
    """verl's ``reward_model.sandbox_fusion`` (verl 0.9: ``reward.sandbox_fusion``; its keys and
    defaults): with ``url`` set (its run_code endpoint, e.g. ``http://host:8080/run_code``), code is
    run by the user's own SandboxFusion service instead of the sandbox on the node."""

    url: Optional[str] = None
    max_concurrent: int = 64  # requests in flight at once from one process
    memory_limit_mb: int = 1024
