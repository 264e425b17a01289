"""Submitting to Slurm with submitit: one task per node, each running torchrun for its ranks.

The job is a submitit ``Checkpointable``: on USR2 (``--signal=USR2@launcher.signal_lead_s``, sent
before the time limit or by ``scancel --signal=USR2``) submitit calls ``TrainingJob.checkpoint``,
which asks the ranks to stop at the next step boundary, waits until they have saved and exited,
and hands back the same job to requeue. A requeued job starts from the latest checkpoint (the
trainer's ``resume_mode=auto``) and the same W&B run. When the ranks stop on their own because the
allocation is about to end, the job requeues itself the same way. ``launcher.max_requeues`` bounds
the loop.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

import submitit

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.schema import Config
from rlhf_hpc.launch import stop
from rlhf_hpc.launch.failure import OK, REQUEUE, launch_command
from rlhf_hpc.launch.local import check_heartbeat_timeout
from rlhf_hpc.launch.node import JOBS_FILE, NodeInfo, NodeJob, node_info, node_torchrun_command
from rlhf_hpc.recipe.load import load_resolved

__all__ = [
    "cancel",
    "check_cluster",
    "have_slurm",
    "job_state",
    "log_files",
    "node_command_preview",
    "run_jobs",
    "sbatch_text",
    "submit",
]


class TrainingJob(submitit.helpers.Checkpointable):
    """The function submitit runs on every node of the allocation (one task per node)."""

    def __init__(self, config_path: str):
        self.config_path = str(config_path)
        self._job: Optional[NodeJob] = None

    def __call__(self) -> str:
        cfg = load_resolved(self.config_path, checks=False)  # (the ranks check it)
        info = node_info()
        self._job = NodeJob(cfg, self.config_path, info)
        code, line = self._job()
        if code == REQUEUE:
            # the ranks stopped on their own (allocation ending): requeue through submitit's path
            print(line, flush=True)
            os.kill(os.getpid(), signal.SIGUSR2)
            return line
        # training is over (or failed: no requeue): a time-limit warning arriving while the job exits
        # must neither requeue it nor kill it (USR2's default action) and turn a finished job into a failed one
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        if code != OK:
            raise RuntimeError(line or f"exit code {code} on node {info.node_rank} (job {info.job_id})")
        if line:
            print(line, flush=True)
        return "completed"

    def checkpoint(self, *args, **kwargs) -> Optional[submitit.helpers.DelayedSubmission]:
        """Called by submitit's USR2 handler (node 0): stop the ranks, wait for the checkpoint,
        requeue unless ``launcher.max_requeues`` is used up."""
        cfg = load_resolved(self.config_path, checks=False)
        run_dir = Path(self.config_path).parent
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", 0))
        run = self._job.run if self._job is not None else None
        if run is not None and run.proc.poll() is None:
            stop.request_stop(run_dir, "slurm signal")
            run.wait(timeout=max(30, cfg.launcher.signal_lead_s - 10))
        if restarts >= cfg.launcher.max_requeues:
            print(f"[rlhf-hpc] not requeuing: launcher.max_requeues={cfg.launcher.max_requeues} reached", flush=True)
            return None
        return submitit.helpers.DelayedSubmission(TrainingJob(self.config_path))


# --------------------------------------------------------------------------------- submission
class _PlanningExecutor(submitit.SlurmExecutor):
    """The same executor and sbatch text on a machine without Slurm (dry runs): submitit's
    executor refuses to exist where there is no ``srun``."""

    @classmethod
    def affinity(cls) -> int:
        return 1


def executor_for(cfg: Config, folder: Path, planning: bool = False) -> submitit.SlurmExecutor:
    """A submitit Slurm executor with the allocation the config asks for."""
    la, tr = cfg.launcher, cfg.trainer
    cls = _PlanningExecutor if planning else submitit.SlurmExecutor
    python = nsys_prefix(Path(folder).parent / "profile") + shlex.quote(sys.executable) if la.nsys else None
    ex = cls(folder=str(folder), max_num_timeout=la.max_requeues, python=python)
    setup = list(la.setup) + ([f"mkdir -p {shlex.quote(str(Path(folder).parent / 'profile'))}"] if la.nsys else [])
    params = dict(
        job_name=tr.experiment_name,
        nodes=tr.nnodes,
        ntasks_per_node=1,
        time=la.time_min,
        signal_delay_s=la.signal_lead_s,
        array_parallelism=la.array_parallelism,
        setup=setup,
    )
    if la.partition:
        params["partition"] = la.partition
    if la.cpus_per_task:
        params["cpus_per_task"] = la.cpus_per_task
        # restated on the step: from Slurm 22.05 to 23.11 srun does not inherit the job's value
        params["srun_args"] = [f"--cpus-per-task={la.cpus_per_task}"]
    if la.mem_gb:
        params["mem"] = f"{la.mem_gb}GB"
    if la.gpu_request == "gpus-per-node":
        params["gpus_per_node"] = cfg.procs_per_node
    elif la.gpu_request == "gres":
        params["gres"] = f"gpu:{cfg.procs_per_node}"
    for key, value in (("account", la.account), ("qos", la.qos), ("constraint", la.constraint)):
        if value:
            params[key] = value
    if la.exclusive:
        params["exclusive"] = True
    extra: dict = {"requeue": True}
    for line in la.additional_sbatch:
        k, _, v = line.lstrip("-").partition("=")
        extra[k] = v if v else True
    params["additional_parameters"] = extra
    ex.update_parameters(**params)
    return ex


def node_command_preview(cfg: Config, config_path: Path) -> list[str]:
    """What each node of the job runs (the dry run shows it): its rendezvous is the job's, known on the node."""
    info = NodeInfo(
        job_id="$SLURM_JOB_ID",
        node_rank=0,
        nnodes=cfg.trainer.nnodes,
        master="$FIRST_HOST",
        port=0,
        restart_count=0,
        end_time=None,
    )
    return [
        a.replace(":0", ":$PORT") if a.startswith("--rdzv-endpoint") else a
        for a in node_torchrun_command(cfg, config_path, info)
    ]


def nsys_prefix(nsys_report_dir: Path) -> str:
    """``launcher.nsys``: Nsight Systems around each node's job process, so torchrun and every rank
    below it are in one report per node, ``<run dir>/profile/nsys_<job>_node<N>.nsys-rep`` (the
    trainer's phases are NVTX ranges in it). ``%q{VAR}`` is expanded by nsys on the node."""
    out = f"{nsys_report_dir}/nsys_%q{{SLURM_JOB_ID}}_node%q{{SLURM_NODEID}}"
    return f"nsys profile --trace=cuda,nvtx,osrt --sample=none --force-overwrite=true --output={shlex.quote(out)} "


def sbatch_text(cfg: Config, folder: Path) -> str:
    """The exact sbatch script submitit writes for this config (what ``--dry-run`` prints)."""
    ex = executor_for(cfg, folder, planning=True)
    return ex._make_submission_file_text(ex._submitit_command_str, "%j")


def check_cluster(cfg: Config) -> None:
    """Ask Slurm before submitting: does the partition exist, can the request ever run?"""
    la, tr = cfg.launcher, cfg.trainer
    if la.partition:
        parts = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=60).stdout.split()
        names = [p.rstrip("*") for p in parts]
        if la.partition not in names:
            raise ConfigError(
                f"launcher.partition: '{la.partition}' is not a partition of this cluster "
                f"(sinfo lists: {', '.join(names) or 'none'})"
            )
    args = [
        "sbatch",
        "--test-only",
        f"--nodes={tr.nnodes}",
        "--ntasks-per-node=1",
        f"--time={la.time_min}",
        "--wrap=true",
    ]
    if la.partition:
        args.append(f"--partition={la.partition}")
    if la.cpus_per_task:
        args.append(f"--cpus-per-task={la.cpus_per_task}")
    if la.mem_gb:
        args.append(f"--mem={la.mem_gb}G")
    if la.gpu_request == "gpus-per-node":
        args.append(f"--gpus-per-node={cfg.procs_per_node}")
    elif la.gpu_request == "gres":
        args.append(f"--gres=gpu:{cfg.procs_per_node}")
    for k, flag in (("account", la.account), ("qos", la.qos), ("constraint", la.constraint)):
        if flag:
            args.append(f"--{k}={flag}")
    out = subprocess.run(args, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        msg = (out.stderr or out.stdout).strip().replace("sbatch: error: ", "")
        raise ConfigError(
            f"Slurm rejects the resource request (trainer.nnodes={tr.nnodes}, trainer.n_gpus_per_node="
            f"{tr.n_gpus_per_node}, launcher.cpus_per_task={la.cpus_per_task}, launcher.mem_gb="
            f"{la.mem_gb}, launcher.partition={la.partition}, launcher.time_min={la.time_min}): {msg}"
        )


def submit(cfgs: list[tuple[Config, Path]]) -> list[str]:
    """Submit one job (or one array job for a sweep); returns the job ids. ``cfgs``: (config,
    written config.yaml path) per element."""
    first_cfg, first_path = cfgs[0]
    check_heartbeat_timeout(first_cfg)
    folder = first_path.parent / "slurm" if len(cfgs) == 1 else first_path.parent.parent / "slurm-sweep"
    ex = executor_for(first_cfg, folder)
    if len(cfgs) == 1:
        jobs = [ex.submit(TrainingJob(str(first_path)))]
    else:
        with ex.batch():
            jobs = [ex.submit(TrainingJob(str(path))) for _, path in cfgs]
    ids = [j.job_id for j in jobs]
    for (cfg, path), job_id in zip(cfgs, ids):
        record = {"job_id": job_id, "submitit_folder": str(folder), "command": launch_command()}
        jobs_file = path.parent / JOBS_FILE
        history = json.loads(jobs_file.read_text()) if jobs_file.is_file() else []
        jobs_file.write_text(json.dumps(history + [record], indent=1))
    return ids


# ------------------------------------------------------------------------- status, logs, cancel
def run_jobs(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / JOBS_FILE
    if not path.is_file():
        raise ConfigError(
            f"{run_dir}: no Slurm jobs recorded here ({JOBS_FILE} is missing): is it a run directory "
            f"of a cluster=slurm launch?"
        )
    return json.loads(path.read_text())


def job_state(job_id: str) -> str:
    out = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True, text=True, timeout=60
    )
    states = [s for s in out.stdout.split() if s]
    if states:
        return states[-1]
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or "UNKNOWN"


def log_files(record: dict) -> list[Path]:
    folder = Path(record["submitit_folder"])
    base = record["job_id"]
    return sorted(folder.glob(f"{base}_*_log.out")) + sorted(folder.glob(f"{base}_*_log.err"))


def cancel(job_id: str) -> None:
    subprocess.run(["scancel", job_id], check=True, timeout=60)


def have_slurm() -> bool:
    return shutil.which("sbatch") is not None
