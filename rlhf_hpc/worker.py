"""What every torchrun rank runs: ``python -m rlhf_hpc.worker RUN_DIR/config.yaml``."""

from __future__ import annotations

import gc
import os
import re
import socket
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.data.dataset import DataError
from rlhf_hpc.distributed.heartbeat import Heartbeat
from rlhf_hpc.distributed.host_allocator import describe_malloc_settings
from rlhf_hpc.distributed.process_group import exit_process, init_distributed
from rlhf_hpc.launch.failure import (
    FAILED,
    GUARD_STOP,
    RUN_DIR_UNWRITABLE,
    Failure,
    lost_peer,
    record_failure,
    unwritable_path,
)
from rlhf_hpc.launch.rank_group import die_with_parent
from rlhf_hpc.launch.stop import install_signal_handler, record_user_error
from rlhf_hpc.launch.watchdog import describe_rank
from rlhf_hpc.observability.library_logs import library_log_path, route_library_logs
from rlhf_hpc.observability.startup import StartupClock
from rlhf_hpc.ppo.guard import GuardStop
from rlhf_hpc.ppo.split_rollout import serve_rollouts
from rlhf_hpc.ppo.trainer import fit
from rlhf_hpc.preflight import PreflightFailed, run_preflight, write_report
from rlhf_hpc.recipe.load import load_resolved

__all__: list[str] = []  # a script: nothing here is imported elsewhere


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m rlhf_hpc.worker RUN_DIR/config.yaml", file=sys.stderr)
        return 2
    run_dir = Path(argv[0]).parent
    clock = StartupClock()  # (from the process's start: the interpreter and the imports)
    clock.mark("imports")
    # the imports' objects live as long as the rank: kept out of the collector's scans (vLLM freezes
    # its heap after its start-up too), the full collections of the engine's start-up skip them
    gc.freeze()
    try:
        cfg = load_resolved(argv[0])
    except ConfigError as e:
        record_user_error(run_dir, f"error: {e}")  # the launcher prints it once for the job
        return 0
    beat = Heartbeat.from_env(run_dir)  # None under a plain torchrun: no launcher watches
    if beat is not None:
        die_with_parent()  # torchrun gone (its launcher was killed): this rank must not train on
        beat.start()
    try:
        clock.mark("config")
        return run_rank(cfg, run_dir, clock)
    except BaseException as e:  # noqa: BLE001 - every end of a rank is classified (a DCP error is a BaseException)
        return rank_failed(e, run_dir, beat)
    finally:
        if beat is not None:
            beat.set_state("exited")


def run_rank(cfg, run_dir: Path, clock: StartupClock) -> int:
    install_signal_handler()  # Slurm's USR2, the local launcher's stop: finish the step, save, stop
    route_library_logs(run_dir, int(os.environ.get("RANK", "0")))  # before vLLM is imported
    ctx = init_distributed(cfg)
    # one collective proves every rank joined the same group on the chosen backend
    ranks = torch.tensor([float(ctx.rank)], device=ctx.device)
    dist.all_reduce(ranks)
    expected = ctx.world_size * (ctx.world_size - 1) / 2
    if ranks.item() != expected:
        raise RuntimeError(f"process group check failed: sum of ranks {ranks.item()} != {expected}")
    # which host each rank runs on: on a multi-node job, proof that the group spans the nodes
    hosts: list = [None] * ctx.world_size
    dist.all_gather_object(hosts, socket.gethostname())
    side = "" if ctx.split is None else f" ({ctx.split.role} side of the split layout)"
    if ctx.is_main:
        print(
            f"[rlhf-hpc] process group up{side}: {ctx.world_size} ranks, backend {ctx.backend}, "
            f"device {ctx.device.type}, hosts by rank: {','.join(hosts)}",
            flush=True,
        )
        if ctx.device.type == "cpu":
            print(f"[rlhf-hpc] host memory: {describe_malloc_settings()}", flush=True)
        print(f"[rlhf-hpc] vLLM's and torch's warnings: {library_log_path(run_dir, '*')}", flush=True)
    clock.mark("process group")
    if cfg.trainer.preflight:
        preflight(cfg, ctx, run_dir)
    elif ctx.split is not None and not ctx.split.is_trainer:
        serve_rollouts(cfg, ctx)  # the split layout's rollout ranks (rlhf_hpc/ppo/split_rollout.py)
    else:
        fit(cfg, ctx, clock)
    if dist.is_initialized():  # a vLLM engine's shutdown already ended the group
        dist.destroy_process_group()
    return 0


# a rank whose collective failed because a peer is gone waits this long for the launcher, which
# knows which rank was lost and ends the group without torchrun's report
LOST_PEER_WAIT_S = 60.0


def rank_failed(e: BaseException, run_dir: Path, beat) -> int:
    """One record for the job instead of a traceback per rank (``rlhf_hpc.launch.failure``): the
    rank's exit code. A rank that recorded the failure exits 0: the launcher reads the record and
    owns the job's exit code, and torchrun adds no report of its own. Under a plain torchrun (no
    launcher reads records) anything but a user error is raised as before."""
    if isinstance(e, (ConfigError, DataError)):
        # a user error every rank meets alike: one line for the job (printed by the launcher)
        record_user_error(run_dir, f"error: {e}")
        return 0
    if beat is None or isinstance(e, (KeyboardInterrupt, SystemExit)):
        raise e
    where = describe_rank(beat.beat)
    unwritable = unwritable_path(e)
    if isinstance(e, GuardStop):
        record_failure(run_dir, Failure(GUARD_STOP, str(e)))  # every rank takes the same decision
    elif unwritable:
        record_failure(run_dir, Failure(RUN_DIR_UNWRITABLE, f"cannot write {unwritable}", where))
    elif lost_peer(e):
        said = re.sub(r"^\[[^]]*\] ", "", str(e).splitlines()[0]).split(". ")[0]  # gloo's words, not its source path
        # one write: the launcher ends this rank soon after, and its own line must not join a half-written one
        sys.stderr.write(
            f"[rlhf-hpc] {where}: a collective failed, a peer is gone ({said}); waiting for the launcher\n"
        )
        sys.stderr.flush()
        beat.set_state("lost peer")
        time.sleep(LOST_PEER_WAIT_S)
        return 1
    else:
        traceback.print_exception(e)  # once, by the rank that failed
        first = str(e).splitlines()[0] if str(e) else ""
        record_failure(
            run_dir, Failure(FAILED, f"{type(e).__name__}{': ' + first if first else ''} (traceback above)", where)
        )
    return 0


def preflight(cfg, ctx, run_dir: Path) -> None:
    """The allocation check in place of training (rlhf_hpc.preflight): a failed check becomes the
    job's one-line error (exit code 2 from the launcher, no requeue)."""

    def log(line: str) -> None:  # rank 0 reports (other ranks' prints would interleave with its lines)
        if ctx.is_main:
            print(f"[rlhf-hpc] preflight: {line}", flush=True)

    checks: list = []
    try:
        checks = run_preflight(cfg, ctx, log, checks)
    except PreflightFailed as e:
        if ctx.is_main:
            report = write_report(run_dir, checks, str(e))
            record_user_error(run_dir, f"error: preflight failed: {e} (report: {report})")
        return
    if ctx.is_main:
        report = write_report(run_dir, checks, None)
        print(f"[rlhf-hpc] preflight passed: {len(checks)} checks ({report})", flush=True)


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
