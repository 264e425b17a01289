"""The sandbox bounds a program's whole memory (rlhf_hpc/tools/memory_bound.py), however it allocates.

Each hostile program below tries to hold 1.5 x ``memory_mb`` one way: several processes, memfd,
SysV shared memory, POSIX shared memory, files in /dev/shm, in /tmp and the working directory, a
tmpfs in a user namespace of its own. Each runs under both bounds (a cgroup per program; rlimits
and capped tmpfs that multiply to memory_mb, with the seccomp filter) in both bwrap modes
(privileged as root; a user namespace as an ordinary user, where rlimits hold, and as root under
the cgroup). What it held is measured from outside: the harness that starts the sandbox
(tests/sandbox_harness.py) runs in a cgroup v1 of the test's own, with no limit, whose peak is read
after the run; a trivial program's peak in the same setting is the baseline. Needs root and a
cgroup v1 memory hierarchy (this machine and CI: a VM with one); elsewhere it skips."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from rlhf_hpc.config.sandbox_schema import SandboxConfig
from rlhf_hpc.config.schema import Config
from rlhf_hpc.tools.backends import SANDBOX_BACKENDS, limits_of
from rlhf_hpc.tools.memory_bound import SandboxUnavailable, cgroup_mounts, memory_bound, own_cgroups
from rlhf_hpc.tools.sandbox import describe, run_in_sandbox, sandbox_backend
from rlhf_hpc.tools.sandbox_checks import sandbox_problems
from tests.conftest import require

REPO = Path(__file__).resolve().parent.parent
HARNESS = REPO / "tests" / "sandbox_harness.py"
MB = 2**20
M = 512  # memory_mb of every run here
TRY = 3 * M // 2  # what each hostile program tries to hold
SLACK_MB = 32  # bwrap's own two processes, the harness's pipes, noise in the baseline
CGROUP = SandboxConfig(timeout_s=10, memory_mb=M, max_processes=16, max_file_mb=8, memory_bound="cgroup")
# (512 - 3 tmpfs x 8) // 128: 3 processes or threads of 128 MB
RLIMITS = replace(CGROUP, memory_bound="rlimits", process_memory_mb=128)
NOBODY = 65534

FILL = """
def fill(write, mb, chunk=16):
    held = 0
    while held < mb:
        write(b'\\x01' * (chunk * 2**20))
        held += chunk
        print('held', held, flush=True)
"""
HOSTILE = {
    "processes": f"""
import os, time
pids = []
for i in range(6):
    try:
        pid = os.fork()
    except OSError as e:
        print('fork refused:', e, flush=True)
        break
    if pid == 0:
        bufs = []
        try:
            for _ in range({TRY} // 6 // 16):
                bufs.append(b'\\x01' * 2**24)
        except MemoryError:
            print('child: MemoryError', flush=True)
        time.sleep(1.0)
        os._exit(0)
    pids.append(pid)
for pid in pids:
    os.waitpid(pid, 0)
""",
    # many small pieces, each under max_file_mb (a file size limit stops one big one), dropped from
    # the address space once written
    "memfd": FILL
    + (f"import os\nfds = []\nfill(lambda b: fds.append(os.memfd_create('x')) or os.write(fds[-1], b), {TRY}, 4)\n"),
    "SysV shared memory": FILL
    + f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
def segment(b):
    shmid = libc.shmget(0, len(b), 0o1600)
    if shmid < 0:
        raise OSError(ctypes.get_errno(), 'shmget')
    addr = libc.shmat(shmid, None, 0)
    ctypes.memmove(addr, b, len(b))
    libc.shmdt(ctypes.c_void_p(addr))  # unmapped, not removed: it stays
fill(segment, {TRY}, 4)
""",
    "POSIX shared memory": FILL
    + f"""
from multiprocessing import shared_memory
def segment(b):
    shm = shared_memory.SharedMemory(create=True, size=len(b))
    shm.buf[:] = b
    shm.close()  # unmapped, not unlinked: it stays
fill(segment, {TRY}, 4)
""",
    "files in /dev/shm": FILL
    + f"""
import itertools
n = itertools.count()
fill(lambda b: open(f'/dev/shm/f{{next(n)}}', 'wb').write(b), {TRY}, chunk=4)
""",
    "files in /tmp and the working directory": FILL
    + f"""
import itertools
names = (('/tmp/' if i % 2 else '') + f'f{{i}}' for i in itertools.count())
fill(lambda b: open(next(names), 'wb').write(b), {TRY}, chunk=4)
""",
    "a tmpfs in a user namespace of its own": FILL
    + f"""
import ctypes, itertools, os
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.getuid(), os.getgid()
if libc.unshare(0x10000000 | 0x00020000) != 0:  # CLONE_NEWUSER | CLONE_NEWNS
    raise OSError(ctypes.get_errno(), 'unshare')
for name, text in (('setgroups', 'deny'), ('uid_map', f'0 {{uid}} 1'), ('gid_map', f'0 {{gid}} 1')):
    with open(f'/proc/self/{{name}}', 'w') as f:
        f.write(text)
os.makedirs('/tmp/m', exist_ok=True)
if libc.mount(b'none', b'/tmp/m', b'tmpfs', 0, None) != 0:
    raise OSError(ctypes.get_errno(), 'mount')
n = itertools.count()
fill(lambda b: open(f'/tmp/m/f{{next(n)}}', 'wb').write(b), {TRY}, chunk=4)
""",
}
SETTINGS = {  # name: (config, bwrap mode, uid the harness runs as)
    "cgroup, privileged": (CGROUP, "privileged", 0),
    "cgroup, userns as root": (CGROUP, "userns", 0),
    "rlimits, privileged": (RLIMITS, "privileged", 0),
    "rlimits, userns as a user": (RLIMITS, "userns", NOBODY),
}
_n = itertools.count()


@pytest.fixture(scope="module")
def measuring_parent() -> Path:
    """The cgroup v1 memory directory the measuring cgroups are made in: this process's own."""
    mounts, own = cgroup_mounts(), own_cgroups()
    require(
        "root and a cgroup v1 memory hierarchy (to measure a program's memory from outside)",
        os.geteuid() == 0 and 1 in mounts and 1 in own,
        "not here",
    )
    point, root = mounts[1]
    path = point / os.path.relpath(own[1], root)
    require("a writable cgroup v1 memory directory", os.access(path, os.W_OK), str(path))
    try:
        sandbox_backend(SandboxConfig(timeout_s=5))
    except SandboxUnavailable as e:
        require("a sandbox (bwrap with namespaces)", False, str(e))
    return path


def measured_run(parent: Path, cfg: SandboxConfig, mode: str, uid: int, program: str) -> tuple[dict, float, list]:
    """(the run's result, the peak MB of the harness and everything it started, cgroups left behind)."""
    measure = parent / f"rlhf-hpc-test-measure-{os.getpid()}-{next(_n)}"
    measure.mkdir()
    spec = json.dumps({"mode": mode, "cfg": asdict(cfg), "program": program})
    if uid == 0:
        python, extra = sys.executable, {}
    else:  # the system's interpreter: root's venv lies under /root, which nobody cannot enter
        require("/usr/bin/python3 (to run as an ordinary user)", Path("/usr/bin/python3").exists(), "absent")
        python, extra = "/usr/bin/python3", {"user": uid, "group": uid, "extra_groups": []}
    site = next(p for p in sys.path if p.endswith("site-packages"))
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{REPO}:{site}"}
    try:
        proc = subprocess.Popen(
            [python, str(HARNESS), spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd="/",
            **extra,
        )
        (measure / "cgroup.procs").write_text(str(proc.pid))
        out, err = proc.communicate("go\n", timeout=120)
        assert proc.returncode == 0, err
        peak = int((measure / "memory.max_usage_in_bytes").read_text()) / MB
        left = [p.name for p in measure.iterdir() if p.is_dir()]
        return json.loads(out.splitlines()[-1]), peak, left
    finally:
        for pid in (measure / "cgroup.procs").read_text().split():
            os.kill(int(pid), signal.SIGKILL)
        for _ in range(100):
            try:
                measure.rmdir()
                break
            except OSError:
                time.sleep(0.05)


@pytest.fixture(scope="module")
def baselines(measuring_parent) -> dict[str, float]:
    """Each setting's peak for a program that allocates nothing."""
    out = {}
    for name, (cfg, mode, uid) in SETTINGS.items():
        result, peak, _ = measured_run(measuring_parent, cfg, mode, uid, "print(6 * 7)")
        assert result["status"] == "ok" and result["stdout"] == "42\n", result
        out[name] = peak
    return out


def held_mb(stdout: str) -> int:
    return max([int(line.split()[1]) for line in stdout.splitlines() if line.startswith("held ")], default=0)


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("how", list(HOSTILE))
def test_a_program_holds_at_most_memory_mb_however_it_allocates(how, setting, measuring_parent, baselines):
    cfg, mode, uid = SETTINGS[setting]
    result, peak, left = measured_run(measuring_parent, cfg, mode, uid, HOSTILE[how])
    kind = "a cgroup v1 per program" if cfg.memory_bound == "cgroup" else "rlimits"
    assert f"memory bound: {kind}" in result["line"] and "refused (seccomp)" in result["line"], result["line"]
    grew = peak - baselines[setting]
    assert grew <= M + SLACK_MB, (
        f"{how} under {setting}: the harness's peak grew by {grew:.0f} MB (memory_mb={M}, tried {TRY})",
        result,
    )
    assert held_mb(result["stdout"]) <= M, result  # what the program itself saw
    if how != "processes":  # (the parent of the refused or killed children may end well)
        assert result["status"] != "ok", result
    assert left == [], left  # no program cgroup outlives its run


# ------------------------------------------------------------------ the bound's arithmetic, refusals and lines
@pytest.mark.parametrize(
    "memory_mb,process_mb,file_mb,max_processes",
    [(1024, 256, 64, 32), (512, 128, 8, 16), (4096, 192, 64, 32), (4096, 64, 1, 8)],
)
def test_the_rlimits_multiply_to_memory_mb(memory_mb, process_mb, file_mb, max_processes):
    """processes x address space + the tmpfs mounts never pass memory_mb, and use most of it
    (up to the process count's cap)."""
    cfg = SandboxConfig(
        memory_mb=memory_mb,
        process_memory_mb=process_mb,
        max_file_mb=file_mb,
        max_processes=max_processes,
        memory_bound="rlimits",
    )
    bwrap = SANDBOX_BACKENDS["bwrap"]
    bound = memory_bound(cfg, bwrap.tmpfs)
    limits = limits_of(cfg, bound, 0)
    total = limits["nproc"] * limits["as"] + bwrap.tmpfs * limits["fsize"]
    assert total <= memory_mb * MB
    assert bound.tasks == max_processes or memory_mb * MB - total < limits["as"]
    assert limits["memlock"] == 0 and limits["msgqueue"] == 0


def test_a_bound_that_cannot_hold_is_refused_in_one_line(tmp_path):
    """rlimits that cannot fit one process, and a cgroup asked for where none can be made: each is
    refused before any program runs, naming the keys and the fix."""
    small = SandboxConfig(memory_mb=256, process_memory_mb=256, max_file_mb=8, memory_bound="rlimits")
    with pytest.raises(SandboxUnavailable, match=r"sandbox.memory_mb=256: .* raise memory_mb to at least 280"):
        memory_bound(small, 3)
    nowhere = SandboxConfig(memory_bound="cgroup", cgroup_parent=str(tmp_path))
    with pytest.raises(
        SandboxUnavailable,
        match="sandbox.memory_bound=cgroup: no cgroup for programs can be made "
        r"here \(.*\). Fixes: sandbox.cgroup_parent=",
    ):
        memory_bound(nowhere, 3)
    cfg = Config()
    cfg.sandbox = small
    errors, _, notes = sandbox_problems(cfg)
    assert len(errors) == 1 and "raise memory_mb to at least 280" in errors[0] and notes == []
    cfg.sandbox = replace(small, memory_bound="cgroups")
    errors, _, _ = sandbox_problems(cfg)
    assert errors == ["sandbox.memory_bound=cgroups: expected one of auto, cgroup, rlimits"]


@pytest.mark.slow
def test_the_dry_run_and_the_first_program_say_which_bound_holds(capsys):
    """auto takes a cgroup where this process may make one (root here), else rlimits; the dry run's
    note and the first program's line say which, with the figures."""
    cfg = Config()
    cfg.sandbox = replace(CGROUP, memory_bound="auto")
    errors, _, notes = sandbox_problems(cfg)
    backend, mode = sandbox_backend(cfg.sandbox)
    can = memory_bound(cfg.sandbox, backend.tmpfs).kind == "cgroup"
    assert errors == [] and len(notes) == 1 and notes[0].startswith(f"sandbox: bwrap ({mode}); memory bound: ")
    assert ("a cgroup v" if can else "rlimits (no cgroup here: ") in notes[0]
    if os.geteuid() == 0 and 1 in cgroup_mounts():
        assert can  # root with a v1 memory hierarchy: the cgroup
    cfg.sandbox = replace(RLIMITS, memory_mb=520)  # a setting no earlier run in this process had
    capsys.readouterr()
    assert run_in_sandbox("print(1)", "", cfg.sandbox).ok
    assert run_in_sandbox("print(2)", "", cfg.sandbox).ok
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[rlhf-hpc] sandbox: ")]
    assert said == [f"[rlhf-hpc] {describe(cfg.sandbox, backend, mode)}"]  # once
    assert (
        "3 processes or threads x 128 MB (sandbox.process_memory_mb) + 3 tmpfs x 8 MB <= sandbox.memory_mb=520 MB"
        in said[0]
    )
