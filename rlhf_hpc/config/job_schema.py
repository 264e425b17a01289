"""The keys of the job around the algorithm: how it is launched (``launcher``: Slurm or this
machine), profiled (``global_profiler``), what its hardware can do (``hardware``) and what the time
plan assumes of the data (``plan``). Sections of ``rlhf_hpc.config.schema.Config``, kept apart from
the algorithm's (verl's) sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

__all__ = ["GlobalProfilerConfig", "HardwareConfig", "LauncherConfig", "PlanConfig"]


@dataclass
class LauncherConfig:
    # auto: Slurm when `sbatch` is on PATH, else this machine
    cluster: Literal["auto", "local", "slurm"] = "auto"
    # slurm/clusters/<name>.yaml: site specifics (partition, account, GPU syntax, modules, container)
    cluster_profile: Optional[str] = None
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    # how the site wants GPUs asked for: --gpus-per-node=N, --gres=gpu:N, or not at all (CPU nodes)
    gpu_request: Literal["gpus-per-node", "gres", "none"] = "gpus-per-node"
    time_min: int = 240
    cpus_per_task: Optional[int] = None
    mem_gb: Optional[int] = None
    exclusive: bool = False
    additional_sbatch: list[str] = field(default_factory=list)  # extra "#SBATCH" lines, e.g. --mail-type=END
    setup: list[str] = field(default_factory=list)  # shell lines before the job: module loads, venv
    container: Optional[str] = None  # command prefix, e.g. "apptainer exec --nv /path/rlhf-hpc-gpu.sif"
    # the interpreter torchrun and the ranks start with inside ``container``, found on the container's
    # PATH (env/rlhf-hpc-gpu.def puts its venv first); the job's own interpreter outside one
    container_python: str = "python"
    # preemption / time limit: Slurm sends USR2 this long before the end (large models need minutes
    # to save); independently, the loop saves and requeues when less than time_margin_s remain
    signal_lead_s: int = 120
    time_margin_s: int = 300
    max_requeues: int = 3
    max_restarts: int = 0  # torchrun restarts of crashed workers
    # a rank whose heartbeat stops this long (stopped, frozen, stuck) ends the run with exit code 5,
    # long before trainer.dist_timeout_s; a stale run-directory lock of another host: twice this
    heartbeat_timeout_s: int = 300
    array_parallelism: int = 16
    # wrap each node's job (torchrun and its ranks) in `nsys profile`; the loop's phases show as
    # NVTX ranges; one report per node in <run dir>/profile/ (rlhf_hpc/launch/slurm.py)
    nsys: bool = False


@dataclass
class GlobalProfilerConfig:
    """verl's ``global_profiler`` (tool torch): torch.profiler traces of chosen steps
    (on the command line ``trainer.profile_steps=[3,4]`` is a shorthand for ``global_profiler.steps``)."""

    tool: str = "torch"  # verl's key; only torch here (Nsight Systems: launcher.nsys=true)
    steps: Optional[list[int]] = None  # global steps to trace, e.g. [3, 4]; null: none
    ranks: Optional[list[int]] = None  # ranks that trace them; null: every rank
    save_path: Optional[str] = None  # null: <run dir>/profile


@dataclass
class HardwareConfig:
    """What a node's hardware can do, for the time plan (rlhf_hpc/planning/hardware.py); a cluster
    profile may set it (``hardware: h100_sxm``). Figures are per GPU and one direction, except
    ``inter_node_gb_s`` (the whole node's network) and ``disk_gb_s`` (per node)."""

    # a name in rlhf_hpc.planning.hardware.PRESETS (h100_sxm, h100_pcie, h100_nvl, h200, a100_80gb_sxm, a100_40gb_*,
    # a100_80gb_pcie, l40s, l40, a40, rtx_a6000, v100, mi300x, mi250), or cpu (this machine's calibration);
    # null: the GPU the run sees (h100_sxm at a dry run) for GPU runs, cpu otherwise
    preset: Optional[str] = None
    bf16_tflops: Optional[float] = None
    fp32_tflops: Optional[float] = None
    hbm_gb_s: Optional[float] = None
    hbm_gb: Optional[float] = None  # also the memory plan's GPU size (trainer.gpu_memory_gb: its deprecated name)
    intra_node_gb_s: Optional[float] = None
    inter_node_gb_s: Optional[float] = None
    host_link_gb_s: Optional[float] = None
    disk_gb_s: Optional[float] = None
    # the CPU calibration file (python launch.py calibrate); null: ~/.cache/rlhf-hpc/calibration/cpu.json
    calibration: Optional[str] = None
    # a local CPU run on a machine without that default file measures the machine first (about a
    # minute, once: rlhf_hpc/launch/first_calibration.py); false: plan with the nominal figures
    first_run_calibration: bool = True


@dataclass
class PlanConfig:
    """What the time plan assumes of the data (rlhf_hpc/planning/time_plan.py): mean tokens of a
    prompt and of a response; null: the maxima (data.max_prompt_length, data.max_response_length),
    an upper bound. A run's own steps are planned with their measured lengths (``plan/<phase>_s``).
    A mean that is set is > 0 and at most its maximum (0 is not "unset": null is; refused at
    validation, rlhf_hpc/recipe/input_checks.py)."""

    prompt_length: Optional[int] = None  # in (0, data.max_prompt_length]; null: data.max_prompt_length
    response_length: Optional[int] = None  # in (0, data.max_response_length]; null: data.max_response_length
    # multi-turn runs only (actor_rollout_ref.rollout.multi_turn.enable): the mean assistant turns of
    # a conversation (null: multi_turn.max_assistant_turns, or 2 where unset), the mean tokens of one
    # tool turn (null: multi_turn.max_tool_response_length characters / 4), the seconds one tool turn
    # waits for its slowest call (null: 0); the response's mean above counts the tool turns, as
    # data.max_response_length does
    assistant_turns: Optional[float] = None
    tool_response_length: Optional[int] = None
    tool_seconds: Optional[float] = None
