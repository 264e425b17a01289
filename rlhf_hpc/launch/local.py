"""Run the job on this machine: one torchrun with ``trainer.n_gpus_per_node`` processes.

The launch holds the run directory's lock (``run_lock``) from before its config is written until
it ends. SIGTERM, SIGINT (Ctrl-C), SIGUSR1 and SIGHUP stop the ranks at the next step boundary with a
checkpoint, as Slurm's warning does; a second one kills them at once. The watchdog ends the group
when a rank dies or hangs. Every end other than success is one line (``failure.describe_run_end``)
with a documented exit code.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import sys
import uuid
from pathlib import Path

from rlhf_hpc.config.engines import planned_engine
from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.schema import Config
from rlhf_hpc.distributed.heartbeat import ENV_INTERVAL, ENV_LAUNCH_ID, HEARTBEAT_DIR, beat_interval
from rlhf_hpc.distributed.host_allocator import malloc_tunables
from rlhf_hpc.launch.failure import (
    BAD_INPUT,
    FAILED,
    OK,
    RESTARTABLE,
    Failure,
    checkpoint_summary,
    describe_run_end,
    interrupted_code,
    launch_command,
    note_in_run_log,
)
from rlhf_hpc.launch.rank_group import Outcome, RankGroup
from rlhf_hpc.launch.run_lock import RunLock
from rlhf_hpc.launch.stop import clear, read_stopped
from rlhf_hpc.launch.watchdog import Watchdog
from rlhf_hpc.planning.hardware import cpu_threads_per_rank
from rlhf_hpc.recipe.load import write_resolved

__all__ = [
    "LAYOUT_SHOWN",
    "STOP_SIGNALS",
    "TORCHRUN_MONITOR",
    "check_heartbeat_timeout",
    "prune_empty_dirs",
    "run_local",
    "standalone_torchrun_command",
    "torchrun_log_dir",
    "worker_env",
]


# set for ranks whose console already shows the plan's layout lines: rank 0 does not repeat them
LAYOUT_SHOWN = "RLHF_HPC_LAYOUT_SHOWN"
# what stops a local run with a checkpoint (a second one: at once)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)


# torchrun polls its ranks every second (its default: 0.1 s): the launcher's watchdog learns of a
# rank's end at once (a pidfd) and ends the group first, so the one report is the launcher's line
TORCHRUN_MONITOR = "--monitor-interval=1"


def torchrun_log_dir(run_dir: str | Path) -> Path:
    """torchrun's own log directory: in the run directory, not a ``/tmp/torchelastic_*`` per launch."""
    return Path(run_dir) / "logs" / "torchrun"


def standalone_torchrun_command(cfg: Config, config_path: str | Path) -> list[str]:
    """The exact command line local mode runs (also what ``--dry-run`` prints)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={cfg.procs_per_node}",
        "--max-restarts=0",
        TORCHRUN_MONITOR,
        f"--log-dir={torchrun_log_dir(Path(config_path).parent)}",
        "-m",
        "rlhf_hpc.worker",
        str(config_path),
    ]


def worker_env(cfg: Config) -> dict[str, str]:
    """Environment for the ranks. CPU ranks share the cores: without a cap on OpenMP threads each
    rank would start one thread per core and they would all fight over them. They also get glibc
    malloc settings that keep freed tensor memory (``rlhf_hpc.distributed.host_allocator``) unless the user set
    their own. GPU ranks get NCCL without cuMem, and a tensor-parallel vLLM with sleep mode NCCL's
    all-reduce only (see below). A variable the user set is kept."""
    env = dict(os.environ)
    if cfg.trainer.device == "cpu":
        if "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(cpu_threads_per_rank(cfg.procs_per_node))
        tunables, _ = malloc_tunables(env)
        if tunables:
            env["GLIBC_TUNABLES"] = tunables
        # torch's C++ warnings go straight to stderr (rlhf_hpc.observability.library_logs cannot route them); on
        # CPU ranks they are vLLM's thread and NUMA binding notes
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    else:  # cuda, or auto (GPU ranks wherever a GPU is found)
        # NCCL's buffers off the CUDA virtual-memory API (cuMem): vLLM's sleep mode frees and remaps
        # memory through that API in the same process, and NCCL buffers allocated through it have
        # crashed colocated engines on wake (verl sets the same for its colocated vLLM)
        env.setdefault("NCCL_CUMEM_ENABLE", "0")
        rollout = cfg.actor_rollout_ref.rollout
        if (
            planned_engine(rollout.name).package == "vllm"
            and rollout.tensor_model_parallel_size > 1
            and rollout.free_cache_engine
        ):
            # NCCL only for the engine's tensor-parallel all-reduce under sleep mode: vLLM's
            # disable_custom_all_reduce (set by the engine) leaves its symmetric-memory and FlashInfer
            # all-reduces on, which keep their own buffers across sleep/wake like the custom one
            env.setdefault("VLLM_ALLREDUCE_USE_SYMM_MEM", "0")
            env.setdefault("VLLM_ALLREDUCE_USE_FLASHINFER", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded at run time
    env[ENV_INTERVAL] = str(beat_interval(cfg.launcher.heartbeat_timeout_s))
    return env


def check_heartbeat_timeout(cfg: Config) -> float:
    timeout = cfg.launcher.heartbeat_timeout_s
    if not timeout > 0:
        raise ConfigError(
            f"launcher.heartbeat_timeout_s: {timeout} is not a number of seconds > 0 (a rank without a "
            f"heartbeat for that long ends the run; the default is 300)"
        )
    return timeout


def prune_empty_dirs(root: Path) -> None:
    """Remove the empty directories under ``root`` (torchrun's per-launch folders), then ``root`` if empty.
    The nodes of a job share the run directory and prune it at once: a folder another node removed
    is no error."""
    dirs = []
    for parent, children, _ in os.walk(root):  # (os.walk skips what vanishes under it; Path.rglob raises)
        dirs += [Path(parent) / c for c in children]
    for path in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        try:
            path.rmdir()
        except OSError:
            pass  # not empty (something was written there), or gone already
    try:
        root.rmdir()
    except OSError:
        pass


def run_local(cfg: Config, config_path: str | Path) -> int:
    """Lock the run directory, write its config, run torchrun until the run ends; returns the exit
    code (``failure.EXIT_CODES``). ``launcher.max_restarts``: after a rank failed, died or hung, a
    new torchrun (fresh rendezvous) resumes from the latest checkpoint. torchrun's own in-place
    restarts are not used here: on gloo its restarted group sometimes never connects (seen with
    torch 2.13 on this kind of machine)."""
    run_dir = Path(config_path).parent
    timeout = check_heartbeat_timeout(cfg)
    # before config.yaml is touched: a second launch on a running run changes nothing there
    with RunLock.acquire(run_dir, stale_after_s=2 * timeout) as lock:
        write_resolved(cfg, run_dir)
        cmd = standalone_torchrun_command(cfg, config_path)
        print(f"[rlhf-hpc] run directory: {run_dir}\n[rlhf-hpc] {shlex.join(cmd)}", flush=True)
        received: list[int] = []
        previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in STOP_SIGNALS}
        try:
            code, line = _attempts(cfg, cmd, run_dir, lock, received)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            prune_empty_dirs(torchrun_log_dir(run_dir))
        if line:
            print(line, file=sys.stderr, flush=True)
            note_in_run_log(run_dir, line)
        return code


def _attempts(cfg: Config, cmd: list[str], run_dir: Path, lock: RunLock, received: list[int]) -> tuple[int, str]:
    """(exit code, the line that says how the run ended; "" for a run that finished)."""
    resume, attempts = launch_command(), cfg.launcher.max_restarts + 1
    every = beat_interval(cfg.launcher.heartbeat_timeout_s)
    for attempt in range(attempts):
        clear(run_dir)
        shutil.rmtree(run_dir / HEARTBEAT_DIR, ignore_errors=True)
        launch_id = uuid.uuid4().hex[:12]
        env = worker_env(cfg)
        env.update(
            {"RLHF_HPC_ATTEMPT": str(attempt), ENV_LAUNCH_ID: launch_id, LAYOUT_SHOWN: "1"}
        )  # this console has the layout lines already (cli printed the plan)
        group = RankGroup(cmd, env, run_dir)
        outcome = group.supervise(
            Watchdog(run_dir, launch_id, cfg.launcher.heartbeat_timeout_s),
            refresh=lambda: lock.refresh(every_s=every),
            signals=received,
        )
        failure = outcome.failure
        if outcome.signals and failure is None:
            return _interrupted(outcome, run_dir, resume)
        if failure is None and outcome.code == 0:
            shutil.rmtree(run_dir / HEARTBEAT_DIR, ignore_errors=True)
            return OK, ""
        if failure is None:  # nothing recorded, nothing found: torchrun's report above is all there is
            failure = Failure(FAILED, f"torchrun exited with code {outcome.code} (its report is above)")
        if failure.code == BAD_INPUT:
            return BAD_INPUT, failure.what  # the user's error in its own words, once
        if failure.code not in RESTARTABLE or attempt + 1 == attempts or outcome.signals:
            return failure.code, describe_run_end(failure, run_dir, resume)
        line = (
            f"[rlhf-hpc] workers failed (exit {failure.code}: {failure.label()}): {failure.summary()}; "
            f"restart {attempt + 1}/{cfg.launcher.max_restarts} from the latest checkpoint "
            f"({checkpoint_summary(run_dir)})"
        )
        print(line, flush=True)
        note_in_run_log(run_dir, line)
    raise AssertionError("unreachable: the last attempt returns")


def _interrupted(outcome: Outcome, run_dir: Path, resume: str) -> tuple[int, str]:
    """The launcher got a stop signal: the ranks stopped with a checkpoint (or, after a second
    signal, were killed)."""
    signum = outcome.signals[0]
    name = signal.Signals(signum).name
    if outcome.code == 0 and not read_stopped(run_dir):
        return OK, f"[rlhf-hpc] {name} arrived as the run finished: nothing to resume"
    how = (
        "the ranks finished their step and saved a checkpoint"
        if outcome.code == 0
        else "the ranks were killed (a second signal): the steps after the last checkpoint are lost"
    )
    code = interrupted_code(signum)
    return code, (
        f"[rlhf-hpc] stopped by {name}: {how}; {checkpoint_summary(run_dir)}; resume with: {resume}; exit code {code}"
    )
