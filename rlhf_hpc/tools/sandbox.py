"""Run an untrusted Python program in the sandbox: ``run_in_sandbox(program, stdin, cfg) -> SandboxResult``.

The backend (``sandbox.backend``, rlhf_hpc/tools/backends.py) is found once per process by running a
small program in it (``sandbox_backend``): auto takes bwrap, else Apptainer, and never the weak
rlimit mode, which runs only when chosen by name. The memory bound (a cgroup per program, else
rlimits that multiply to ``memory_mb``: rlhf_hpc/tools/memory_bound.py) is found with it; the first
program of a process prints both in one line. Each run gets a fresh stage directory, its own
session (the whole tree is killed with SIGKILL at ``timeout_s``: a program that ignores SIGTERM
changes nothing), and at most ``max_output_kb`` of each stream (beyond it the program is stopped).
Whatever the program does comes back as a status and an error string for the model, is counted in
``SANDBOX_METRICS``, and never raises; only a sandbox that cannot run here at all raises
``SandboxUnavailable``, naming the fix.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Union

from rlhf_hpc.config.sandbox_schema import SandboxConfig
from rlhf_hpc.tools import sandbox_launcher
from rlhf_hpc.tools.backends import AUTO_ORDER, SANDBOX_BACKENDS, SandboxBackend, bwrap_binary, interpreter
from rlhf_hpc.tools.memory_bound import MemoryBound, SandboxUnavailable, memory_bound, program_cgroup
from rlhf_hpc.tools.sandbox_metrics import SANDBOX_METRICS

__all__ = [
    "GRACE_S",
    "SandboxResult",
    "SandboxUnavailable",
    "classify",
    "describe",
    "run_in_sandbox",
    "run_with",
    "sandbox_backend",
    "userns_note",
]

Program = Union[str, dict[str, str]]  # a program, or its files by relative path (main.py runs)
GRACE_S = 2.0  # after the kill: how long the pipes may take to close
PROBE_PROGRAM = "print(6 * 7)"


@dataclass(frozen=True)
class SandboxResult:
    """``status``: one of rlhf_hpc.tools.sandbox_metrics.STATUSES; ``error``: what the model is told when it
    is not ok ("" when it is); stdout and stderr at most ``max_output_kb`` each."""

    status: str
    exit_code: Optional[int]
    stdout: str
    stderr: str
    seconds: float
    backend: str
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# ------------------------------------------------------------------ which backend works here
_probed: dict[tuple, Optional[str]] = {}
_probe_lock = threading.Lock()


def userns_note() -> str:
    """Why unprivileged user namespaces may be off on this machine ("" where nothing says so)."""
    settings = (
        ("/proc/sys/user/max_user_namespaces", "0", "user namespaces are disabled (user.max_user_namespaces=0)"),
        (
            "/proc/sys/kernel/unprivileged_userns_clone",
            "0",
            "unprivileged user namespaces are disabled (kernel.unprivileged_userns_clone=0)",
        ),
        (
            "/proc/sys/kernel/apparmor_restrict_unprivileged_userns",
            "1",
            "AppArmor restricts unprivileged user namespaces (Ubuntu 24.04's default, "
            "kernel.apparmor_restrict_unprivileged_userns=1) unless a profile allows bwrap",
        ),
    )
    notes = []
    for path, off, note in settings:
        try:
            if Path(path).read_text().strip() == off:
                notes.append(note)
        except OSError:
            pass  # the setting does not exist on this kernel
    return "; ".join(notes)


def probe(backend: SandboxBackend, mode: str, cfg: SandboxConfig) -> Optional[str]:
    """None when a small program runs in ``backend`` (``mode``) here and prints what it should;
    else what went wrong. Once per process and setting."""
    key = (
        backend.name,
        mode,
        interpreter(cfg),
        bwrap_binary(),
        cfg.apptainer_image,
        tuple(cfg.ro_binds),
        cfg.memory_mb,
        cfg.max_file_mb,
        memory_bound(cfg, backend.tmpfs),
    )
    with _probe_lock:
        if key not in _probed:
            # a slow node's first start (page cache cold) must not read as "no sandbox"
            result = run_with(backend, mode, replace(cfg, timeout_s=max(cfg.timeout_s, 30.0)), PROBE_PROGRAM, b"")
            _probed[key] = (
                None
                if result.ok and result.stdout.strip() == "42"
                else (f"{result.status}: {(result.stderr or result.error).strip()[-500:]}")
            )
        return _probed[key]


def sandbox_backend(cfg: SandboxConfig) -> tuple[SandboxBackend, str]:
    """The backend (and mode) programs run in here: ``sandbox.backend``, or for auto the first of
    AUTO_ORDER that runs a program; raises SandboxUnavailable with every reason and the fixes."""
    names = AUTO_ORDER if cfg.backend == "auto" else (cfg.backend,)
    reasons = []
    for name in names:
        backend = SANDBOX_BACKENDS[name]  # an unknown name: ConfigError with the registered names
        missing = backend.missing(cfg)
        if missing:
            reasons.append(f"{name}: {missing}")
            continue
        for mode in backend.modes(cfg):
            why = probe(backend, mode, cfg)
            if why is None:
                return backend, mode
            reasons.append(f"{name} ({mode}): {why}")
    note = userns_note()
    raise SandboxUnavailable(
        f"sandbox.backend={cfg.backend}: no sandbox runs programs on this machine: "
        + "; ".join(reasons)
        + (f". Here {note}" if note else "")
        + ". Fixes: where the site has Apptainer, sandbox.backend=apptainer with sandbox.apptainer_image=<a .sif "
        "with python3>; or reward_model.sandbox_fusion.url=<your SandboxFusion service>/run_code; or, knowing "
        "that a program then sees your files and the network, sandbox.backend=rlimit (limits only)"
    )


# ------------------------------------------------------------------ one run
_slots: dict[int, threading.BoundedSemaphore] = {}
_slots_lock = threading.Lock()


def slots(n: int) -> threading.BoundedSemaphore:
    """The process-wide limit of programs at once (sandbox.max_parallel)."""
    with _slots_lock:
        return _slots.setdefault(n, threading.BoundedSemaphore(max(1, n)))


def describe(cfg: SandboxConfig, backend: SandboxBackend, mode: str) -> str:
    """Where programs run here and what holds their memory, in one line."""
    where = backend.name + ("" if mode == "default" else f" ({mode})")
    return f"sandbox: {where}; {memory_bound(cfg, backend.tmpfs).line(cfg)}"


_announced: set[str] = set()


def run_in_sandbox(
    program: Program, stdin: Union[str, bytes] = b"", cfg: Optional[SandboxConfig] = None
) -> SandboxResult:
    """Run ``program`` (source of main.py, or {relative path: source} with a main.py) with ``stdin``
    under ``cfg``'s limits in the backend that works here; its outcome is counted in SANDBOX_METRICS.
    The first program of each setting prints where it runs and its memory bound (a job's nodes may
    differ from the login node the dry run checked)."""
    cfg = cfg or SandboxConfig()
    backend, mode = sandbox_backend(cfg)
    line = describe(cfg, backend, mode)
    if line not in _announced:
        _announced.add(line)
        print(f"[rlhf-hpc] {line}", file=sys.stderr, flush=True)
    with slots(cfg.max_parallel):
        result = run_with(backend, mode, cfg, program, stdin.encode() if isinstance(stdin, str) else stdin)
    SANDBOX_METRICS.record(result.status, result.seconds)
    return result


def stage_files(stage: Path, program: Program) -> None:
    """The program's files under ``stage/files`` (paths inside it only), the launcher beside them."""
    files = {"main.py": program} if isinstance(program, str) else dict(program)
    if "main.py" not in files:
        raise ValueError(f"a program's files need a main.py (got {', '.join(files)})")
    for rel, text in files.items():
        path = (stage / "files" / rel).resolve()
        if not path.is_relative_to((stage / "files").resolve()) or rel.startswith("/"):
            raise ValueError(f"a program's file must lie inside its directory: {rel!r}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8", errors="replace")  # a lone surrogate of a decoded response
    shutil.copyfile(sandbox_launcher.__file__, stage / "launcher.py")


def run_with(backend: SandboxBackend, mode: str, cfg: SandboxConfig, program: Program, stdin: bytes) -> SandboxResult:
    """One run in ``backend`` (``mode``), not counted: ``run_in_sandbox`` is the entry point. Under a
    cgroup bound the run has a cgroup of its own; a program the kernel killed at its limit reads as
    ``memory``."""
    bound = memory_bound(cfg, backend.tmpfs)
    cgroup = program_cgroup(bound, cfg)
    with (
        tempfile.TemporaryDirectory(prefix="rlhf-hpc-sandbox-", ignore_cleanup_errors=True) as tmp,
        contextlib.ExitStack() as stack,
    ):
        stage = Path(tmp)
        (stage / "files").mkdir()
        stage_files(stage, program)
        start = time.monotonic()
        try:
            if cgroup is not None:
                stack.enter_context(cgroup)  # on the way out: what is left of the program, then the cgroup
            launch = backend.command(cfg, stage, mode, bound)  # asks the interpreter for its prefixes
            proc = subprocess.Popen(
                cgroup.wrap(launch.argv) if cgroup is not None else launch.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=launch.env,
                cwd=launch.cwd,
                start_new_session=True,
            )
        except (OSError, subprocess.SubprocessError) as e:  # no interpreter there, no bwrap binary, no cgroup
            return SandboxResult("sandbox_error", None, "", "", 0.0, backend.name, f"SandboxError: {e}")
        out, err, stopped = communicate(proc, stdin, start + cfg.timeout_s, cfg.max_output_kb * 1024)
        seconds = time.monotonic() - start
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    status, error = classify(
        proc.returncode,
        stderr,
        stopped,
        cfg,
        translate_signals=backend.signal_as_exit,
        bound=bound,
        oom_killed=bool(cgroup and cgroup.oom_kills),
    )
    return SandboxResult(status, proc.returncode, stdout, stderr, seconds, backend.name, error)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL to the run's process group and to the children of its leader: bwrap's child is the
    pid namespace's init (in a session of its own), whose death ends every process in the namespace
    however it forked or whatever signals it ignores."""
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    except OSError:
        children = []  # gone already, or a kernel without the file: the group kill still ends it
    for pid in [*map(int, children), -proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)  # a negative pid: the whole process group
        except ProcessLookupError:
            pass  # already gone


def communicate(
    proc: subprocess.Popen, stdin: bytes, deadline: float, max_bytes: int
) -> tuple[bytes, bytes, Optional[str]]:
    """Feed ``stdin``, keep at most ``max_bytes`` of each stream, kill the tree at ``deadline`` or at
    the first byte beyond ``max_bytes``. Returns (stdout, stderr, "timeout" / "output_limit" / None)."""
    sel = selectors.DefaultSelector()
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    for stream in bufs:
        sel.register(stream, selectors.EVENT_READ)
    if stdin:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    sent, stopped, hard_end = 0, None, None
    while sel.get_map():
        now = time.monotonic()
        if stopped is None and now >= deadline:
            kill_tree(proc)
            stopped = "timeout"
        if stopped is not None:
            hard_end = hard_end or now + GRACE_S
            if now >= hard_end:
                break  # a pipe still held open after the kill: give up on it
        wait = (hard_end if stopped else deadline) - now
        for key, _ in sel.select(timeout=max(0.0, min(wait, 0.5))):
            if key.fileobj is proc.stdin:
                try:
                    sent += os.write(proc.stdin.fileno(), stdin[sent : sent + 65536])
                except BlockingIOError:
                    continue  # the pipe filled meanwhile: wait for room
                except BrokenPipeError:
                    sent = len(stdin)  # the program stopped reading: the rest is not needed
                if sent >= len(stdin):
                    sel.unregister(proc.stdin)
                    proc.stdin.close()
                continue
            data = os.read(key.fileobj.fileno(), 65536)
            if not data:
                sel.unregister(key.fileobj)
                continue
            buf = bufs[key.fileobj]
            room = max_bytes - len(buf)
            buf += data[:room]
            if len(data) > room and stopped is None:
                kill_tree(proc)
                stopped = "output_limit"
    sel.close()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if not stream.closed:
            stream.close()
    try:
        proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        proc.wait()
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), stopped


# the end of stderr that names an outcome of a limit, for a non-zero exit (Python's messages,
# and C/C++'s)
STDERR_SIGNS = (
    ("memory", ("MemoryError", "Cannot allocate memory", "std::bad_alloc")),
    ("process_limit", ("BlockingIOError: [Errno 11]", "Resource temporarily unavailable", "can't start new thread")),
    ("file_limit", ("File too large", "No space left on device")),
)
SIGNAL_STATUS = {signal.SIGXCPU: "timeout", signal.SIGXFSZ: "file_limit"}


def classify(
    rc: int,
    stderr: str,
    stopped: Optional[str],
    cfg: SandboxConfig,
    translate_signals: bool,
    bound: Optional[MemoryBound] = None,
    oom_killed: bool = False,
) -> tuple[str, str]:
    """(status, error string for the model) of a finished run. ``translate_signals``: the backend
    reports a program's death by signal N as exit code 128 + N (bwrap, apptainer); ``oom_killed``:
    the kernel killed a process of the program at its cgroup's limit."""
    tasks = bound.tasks if bound is not None else cfg.max_processes
    per_process = f" ({bound.process_mb} MB per process)" if bound is not None and bound.kind == "rlimits" else ""
    limits = {
        "timeout": f"TimeoutError: the program ran longer than {cfg.timeout_s:g} s and was stopped",
        "output_limit": f"OutputLimitError: the program wrote more than {cfg.max_output_kb} KB to one "
        f"stream and was stopped",
        "memory": f"MemoryError: the program needed more than {cfg.memory_mb} MB{per_process}",
        "process_limit": f"ProcessLimitError: the program tried to run more than {tasks} processes or threads",
        "file_limit": f"FileLimitError: the program wrote more than {cfg.max_file_mb} MB",
    }
    tail = stderr[-2000:]
    if stopped:
        return stopped, limits[stopped]
    if rc == 0:
        return "ok", ""
    if oom_killed:
        return "memory", limits["memory"]
    launch_failed = rc == sandbox_launcher.LAUNCH_FAILED and "sandbox launcher:" in tail
    if launch_failed or (rc == 1 and stderr.startswith("bwrap:")):
        return "sandbox_error", f"SandboxError: {tail.strip()}"
    sig = -rc if rc < 0 else rc - 128 if translate_signals and rc > 128 else None
    if sig is not None:
        status = SIGNAL_STATUS.get(sig, "killed")
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        return status, limits.get(status, f"the program was killed by signal {name}")
    for status, signs in STDERR_SIGNS:
        if any(s in tail for s in signs):
            return status, f"{limits[status]}\n{tail.strip()}"
    return "error", tail.strip() or f"the program exited with code {rc}"
