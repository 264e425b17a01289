"""Shared test helpers.

Tests that need an optional component (vLLM, Slurm, the ../shared data) skip when it is missing,
except where ``RLHF_HPC_REQUIRE_ALL=1`` (set by ``.ci/run``): there a missing component fails the
test, so CI never passes by skipping.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import io
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


def seed_base() -> int:
    """``RLHF_HPC_TEST_SEED`` (default 0), added to the seeds of the tests' teaching runs and of the
    runs whose sampled behaviour they assert: the same suite under another seed base shows that no
    assertion holds for one seed only (tests/README.md)."""
    value = os.environ.get("RLHF_HPC_TEST_SEED", "0")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"RLHF_HPC_TEST_SEED={value!r} is not an integer") from None


def seed_args() -> list[str]:
    """The training launch's seed under another seed base (none under the default): a test that
    starts ``launch.py`` itself adds these, as ``run_launch`` does."""
    base = seed_base()
    return [f"trainer.seed={42 + base}"] if base else []


def require(component: str, available: bool, why: str = "") -> None:
    if available:
        return
    msg = f"{component} is not available{': ' + why if why else ''}"
    if os.environ.get("RLHF_HPC_REQUIRE_ALL") == "1":
        pytest.fail(f"{msg} (required: RLHF_HPC_REQUIRE_ALL=1)")
    pytest.skip(msg)


def engine_available(name: str) -> None:
    if name == "vllm":
        require("vLLM", importlib.util.find_spec("vllm") is not None, "install the cpu profile (env/setup.sh cpu)")


@pytest.fixture(scope="module")
def smollm() -> str:
    """The real model (SmolLM2-135M-Instruct) on disk, prepared once per machine (rlhf_hpc.models.real_model)."""
    from rlhf_hpc.models import real_model

    try:
        return str(real_model.prepare(log=lambda *_: None))
    except real_model.PrepareError as e:
        require("the real model (SmolLM2-135M-Instruct)", False, str(e))


@pytest.fixture
def shared_dir() -> Path:
    require("../shared", SHARED.is_dir(), f"{SHARED} is missing")
    return SHARED


def run_launch(
    *args: str, cwd: Path = REPO, timeout: float = 300, env: dict | None = None, fresh: bool = False
) -> subprocess.CompletedProcess:
    """``python launch.py ARGS`` in its own process, as a user would type it: forked from a server
    that imported the launcher once (``tests.launcher_fork``: what it starts is started as from the
    script), or with ``fresh`` the script in a new interpreter. Under another seed base
    (``RLHF_HPC_TEST_SEED``), a training launch that names no seed gets ``trainer.seed`` moved by it."""
    full_env = dict(os.environ, **(env or {}))
    if (
        args
        and "=" in args[0]
        and "--dry-run" not in args
        and not any(a.startswith(("trainer.seed=", "-")) for a in args)
    ):
        args = (*args, *seed_args())
    if not fresh:
        from tests.launcher_fork import launch_in_fork

        return launch_in_fork(REPO / "launch.py", list(args), cwd, full_env, timeout)
    return subprocess.run(
        [sys.executable, str(REPO / "launch.py"), *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def launch_here(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``python launch.py ARGS`` in this process, for what starts nothing (dry runs, refusals, plans,
    read-only commands): its return code, standard output and error, as ``run_launch`` gives them,
    without a subprocess's seconds of imports."""
    from rlhf_hpc.cli import main

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse's --help and usage errors
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["launch.py", *args], code, out.getvalue(), err.getvalue())


def wandb_records(wandb_file):
    """The protobuf ``Record`` messages of an offline W&B run file (``run-<id>.wandb``): a 7-byte
    header, then leveldb-log blocks of 32 KiB. A record the writer has not finished (the file is
    read while W&B's service process still writes it) ends the list."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(wandb_file).read_bytes()
    block, hdr, pos, buf = 32768, 7, 7, b""
    while pos + hdr <= len(data):
        left = block - pos % block
        if left < hdr:  # block trailer padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + hdr])
        if kind not in (1, 2, 3, 4) or pos + hdr + length > len(data):
            return  # not written yet (zeros, or a chunk cut short)
        chunk = data[pos + hdr : pos + hdr + length]
        pos += hdr + length
        buf = chunk if kind in (1, 2) else buf + chunk  # FULL/FIRST start, MIDDLE/LAST continue
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec


def wandb_run_record(wandb_file: Path):
    """The run record (id, group, tags, config) of an offline W&B run file."""
    for rec in wandb_records(wandb_file):
        if rec.WhichOneof("record_type") == "run":
            return rec.run
    return None


def wandb_history(wandb_file: Path) -> list[dict]:
    """The rows W&B kept (its history records), each as {key: value}, ``_step`` included."""
    import json

    rows = []
    for rec in wandb_records(wandb_file):
        if rec.WhichOneof("record_type") == "history":
            rows.append(
                {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in rec.history.item}
            )
    return rows


def wandb_history_so_far(wandb_file: Path) -> list[dict]:
    """``wandb_history`` of a file W&B's service process may still be writing: none while a record
    is half written (a torn read), which the caller's wait retries."""
    from google.protobuf.message import DecodeError

    try:
        return wandb_history(wandb_file)
    except DecodeError:
        return []


# The fast tier (`-m "not slow"`) starts nothing: a test outside `slow` whose setup or body starts a
# process (torchrun, launch.py, sbatch, bwrap, an engine's workers) is stopped there and fails, naming
# what it started.
STARTS = ("subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.system", "os.exec", "os.spawn")
fast_test: list[str] = []  # the node id of the running test when it is not marked slow


class StartsAProcess(RuntimeError):
    pass


refused: list[str] = []  # what a fast test tried to start (whether or not the code under test caught it)


def _refuse_start(what: str) -> None:
    if fast_test:
        refused.append(what[:160])
        raise StartsAProcess(f"{fast_test[0]} is not marked slow and starts {what[:160]}: mark it slow")


def _audit(event: str, args: tuple) -> None:
    if event in STARTS:
        _refuse_start(f"{event} {args[0] if args else ''}")


sys.addaudithook(_audit)
_mp_start = multiprocessing.process.BaseProcess.start


def _checked_mp_start(self):  # multiprocessing's spawn and forkserver raise no audit event
    _refuse_start(f"multiprocessing {self.name}")
    return _mp_start(self)


multiprocessing.process.BaseProcess.start = _checked_mp_start


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _fast_unless_slow(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _fast_unless_slow(item))


def _fast_unless_slow(item):
    fast_test[:] = [] if item.get_closest_marker("slow") else [item.nodeid]
    refused.clear()
    try:
        result = yield
    finally:
        fast_test.clear()
    if refused:  # the code under test caught the refusal: the test still fails
        pytest.fail(f"{item.nodeid} is not marked slow and starts {refused[0]}: mark it slow (tests/README.md)")
    return result


# Two workers (pytest-xdist, setup.cfg's addopts) share this machine's cores:
# - each test file runs on one worker (its module fixtures built once), and the Slurm files on one
#   worker together, first (one cluster, the longest group);
# - a test marked `exclusive` (it asserts on wall time or on another job's timing, or its run plans
#   most of the host's memory) runs while the other worker runs nothing: a readers-writer lock over
#   the two workers (a turnstile in front, so an exclusive test is not starved). Getting it means
#   waiting for the other worker's current test to end, so a file's exclusive tests run last in
#   it, one after the other, and the lock is held from the first to the last of them: one wait per
#   file, not one per test. The time each worker waited is summed at the end of the run;
# - the CPU calibration the plans read (~/.cache/rlhf-hpc/calibration/cpu.json) is measured once, alone,
#   before the first slow test that finds it missing: by a one-step local run, which on a machine
#   without the file calibrates first, as a user's first run does (``calibrate_once``).
SAME_WORKER = {"test_slurm": "slurm", "test_slurm_multinode": "slurm"}
LOCKS = Path(os.environ.get("RLHF_HPC_TEST_LOCKS", f"/tmp/rlhf-hpc-tests-{os.getuid()}"))
WAITS = "RLHF_HPC_TEST_WAITS"  # the file the workers add their waits for the CPU lock to (one run's)
CALIBRATED = "RLHF_HPC_TEST_CALIBRATED"  # the file telling the first run that calibrated this machine, if one did


def pytest_xdist_make_scheduler(config, log):
    """Whole test files to the workers (``--dist loadfile``), the Slurm files as one."""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SAME_WORKER.get(Path(path).stem, path)

    config.option.loadscopereorder = False  # xdist would order the files by test count: ours, below
    return FileScheduling(config, log)


# the files that take longest, longest first (worker-seconds on two workers, two clean-clone runs of
# session 69, tests/README.md): handed out first, so the workers end together instead of one
# finishing a long file alone while the other idles. The first three as before (the tool demo's
# teaching and the Slurm files' waits start together; the real model's exclusive runs then hold
# both cores), the rest by their measured time; the files under 10 s follow in collection order.
LONGEST_FIRST = (
    "test_multi_turn",  # 382
    "slurm",  # 669
    "test_real_model",  # 425
    "test_train_e2e",  # 154
    "test_reliability",  # 144
    "test_split_layout",  # 134
    "test_lora",  # 129
    "test_architectures",  # 87
    "test_run_lifecycle",  # 78
    "test_gpu_check",  # 62
    "test_rollout_tp",  # 58
    "test_profiling",  # 51
    "test_retool",  # 50
    "test_moe_routing",  # 45
    "test_sequence_parallel",  # 39
    "test_rollout_dist",  # 37
    "test_code_rl",  # 36
    "test_launch",  # 35
    "test_preflight",  # 35
    "test_verl_parity",  # 34
    "test_engine_dist",  # 33
    "test_rollout_correction",  # 31
    "test_sandbox",  # 28
    "test_pf_ppo",  # 26
    "test_compare",  # 25
    "test_reward_model",  # 21
    "test_bypass_mode",  # 19
    "test_val_generations",  # 18
    "test_dapo",  # 14
    "test_sandbox_memory",  # 13
    "test_distribute",  # 13
    "test_estimators_verl",  # 12
)


def exclusive(item) -> bool:
    return item is not None and item.get_closest_marker("exclusive") is not None


def pytest_collection_modifyitems(config, items):
    files: dict[str, int] = {}
    for item in items:
        files.setdefault(str(item.fspath), len(files))

    def rank(item) -> tuple[int, int, bool]:
        scope = SAME_WORKER.get(Path(str(item.fspath)).stem, Path(str(item.fspath)).stem)
        first = LONGEST_FIRST.index(scope) if scope in LONGEST_FIRST else len(LONGEST_FIRST)
        return first, files[str(item.fspath)], exclusive(item)

    items.sort(key=rank)  # stable: the rest keep their order; a file's exclusive tests last in it


def pytest_configure(config):
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    if workers > 1:
        # the workers' own torch (teaching, in-process models): OpenMP's threads spin while they wait
        # for a core, so two workers of two threads each on two cores spent more than twice the CPU
        # seconds (27 CPU-s for 20 steps of the tool demo's teaching, 12 with one thread). With the
        # threads waiting passively (OMP_WAIT_POLICY, read once, as libgomp loads with torch) a
        # worker takes every core: 30 steps of that teaching, 1 -> 2 threads, 14.7 -> 10.6 s where the
        # other core is free (a Slurm test sleeping through a requeue), 14.1 -> 15.1 s and the same
        # CPU seconds beside a busy one. The processes the tests start keep the default policy and
        # set their own threads.
        before = os.environ.get("OMP_WAIT_POLICY")
        passive = "torch" not in sys.modules  # (else its OpenMP read the policy already)
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        import torch

        if before is None:
            del os.environ["OMP_WAIT_POLICY"]
        else:
            os.environ["OMP_WAIT_POLICY"] = before
        cores = os.cpu_count() or 1
        torch.set_num_threads(cores if passive else max(1, cores // workers))
    if not hasattr(config, "workerinput") and WAITS not in os.environ:  # the controller (or no xdist)
        LOCKS.mkdir(parents=True, exist_ok=True)
        os.environ[WAITS] = str(LOCKS / f"waits-{os.getpid()}.txt")  # (the workers inherit it)
        os.environ[CALIBRATED] = str(LOCKS / f"calibrated-{os.getpid()}.txt")
        for name in (WAITS, CALIBRATED):
            Path(os.environ[name]).unlink(missing_ok=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not hasattr(config, "workerinput"):
        Path(os.environ.get(CALIBRATED, "/nonexistent")).unlink(missing_ok=True)
    path = Path(os.environ.get(WAITS, "/nonexistent"))
    if hasattr(config, "workerinput") or not path.is_file():
        return
    waits = [line.split(" ", 1) for line in path.read_text().splitlines() if line]
    total = sum(float(w) for w, _ in waits)
    longest = sorted(waits, key=lambda w: -float(w[0]))[:5]
    terminalreporter.write_line(
        f"waits for the CPU lock (tests/conftest.py): {total:.0f} worker-s in {len(waits)} waits; longest: "
        + ", ".join(f"{float(w):.0f} s before {nodeid}" for w, nodeid in longest)
    )
    path.unlink(missing_ok=True)


class CpuShare:
    """This worker's hold on the CPU lock: shared by ordinary tests, alone by exclusive ones (nothing
    without xdist). An exclusive hold is kept while the next test is exclusive too."""

    def __init__(self):
        self.files = None  # (turnstile, cpu) while held
        self.alone = False

    def acquire(self, alone: bool, nodeid: str) -> None:
        if not os.environ.get("PYTEST_XDIST_WORKER"):
            return
        if self.files is not None:
            if self.alone == alone:
                return
            self.release()
        LOCKS.mkdir(parents=True, exist_ok=True)
        turnstile, cpu = open(LOCKS / "turnstile", "a"), open(LOCKS / "cpu", "a")
        start = time.monotonic()
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        fcntl.flock(cpu, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        waited = time.monotonic() - start
        if waited >= 1.0 and os.environ.get(WAITS):
            with open(os.environ[WAITS], "a") as f:  # (short appends: whole lines)
                f.write(f"{waited:.1f} {nodeid}\n")
        self.files, self.alone = (turnstile, cpu), alone

    def release(self) -> None:
        if self.files is None:
            return
        turnstile, cpu = self.files
        fcntl.flock(cpu, fcntl.LOCK_UN)
        turnstile.close()
        cpu.close()
        self.files = None


CPU_SHARE = CpuShare()


@contextlib.contextmanager
def cpu_share(alone: bool, nodeid: str = "", keep: bool = False):
    """Held while a test runs (``alone``: an exclusive test); ``keep``: still held after, for the
    next test, exclusive too."""
    CPU_SHARE.acquire(alone, nodeid)
    try:
        yield
    finally:
        if not keep:
            CPU_SHARE.release()


# the suite's first run on a machine without the calibration file: the smallest local run (one step,
# transformers' engine), which measures the machine before it plans, as a user's first run does
FIRST_RUN = (
    "recipe=tiny_klppo",
    "actor_rollout_ref.rollout.name=hf",
    "trainer.total_training_steps=1",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
)


def calibrate_once() -> None:
    """On a machine without the calibration file, alone: the suite's first run (``FIRST_RUN``), which
    calibrates the CPU (``launch.py calibrate``'s bench, vLLM's figures included) and plans with what
    it measured. What it printed and the file it wrote are kept for the tests of the first run
    (``suite_first_run``)."""
    from rlhf_hpc.planning.hardware import calibration_path

    if calibration_path().is_file():
        return
    held = CPU_SHARE.files is not None and CPU_SHARE.alone
    with cpu_share(alone=True, nodeid="the first run (it calibrates the CPU)", keep=held):
        if not calibration_path().is_file():  # the other worker may have measured it meanwhile
            with tempfile.TemporaryDirectory(prefix="rlhf-hpc-first-run-") as run_dir:
                out = run_launch(*FIRST_RUN, f"trainer.default_local_dir={run_dir}", timeout=900)
            assert out.returncode == 0, f"the suite's first run failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
            if CALIBRATED in os.environ:
                record = {"calibration": str(calibration_path()), "stdout": out.stdout}
                Path(os.environ[CALIBRATED]).write_text(json.dumps(record))


def suite_first_run() -> dict | None:
    """The suite's first run, where it calibrated this machine (``calibrate_once``, on either worker):
    ``calibration`` (the file it wrote) and ``stdout``; None where the machine had the file."""
    marker = Path(os.environ.get(CALIBRATED, "/nonexistent"))
    return json.loads(marker.read_text()) if marker.is_file() else None


def suite_calibration() -> Path | None:
    """The file this run's first run measured (``calibrate_once``), or None where the machine had one."""
    first = suite_first_run()
    return None if first is None else Path(first["calibration"])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if item.get_closest_marker("slow"):
        calibrate_once()
    alone = exclusive(item)
    with cpu_share(alone, item.nodeid, keep=alone and exclusive(nextitem)):
        return (yield)
