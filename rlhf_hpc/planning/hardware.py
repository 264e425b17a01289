"""What a node's hardware can do, for the time plan (rlhf_hpc.planning.time_plan): the figures of
common GPUs from their public datasheets, and the CPU's as this project's calibration bench
measured them on the machine it runs on (``python launch.py calibrate``).

A run names its hardware with ``hardware.preset`` (a cluster profile may set it: ``hardware: h100_sxm``
in slurm/clusters/<site>.yaml); any figure can be given instead or on top (``hardware.hbm_gb_s=...``).
Null: ``h100_sxm`` for GPU runs, ``cpu`` for CPU runs.

Figures are per GPU (per rank on a CPU) and per direction: dense bf16 (no sparsity), HBM bandwidth
and size, the intra-node link (NVLink, or PCIe where the GPUs have no NVLink), the inter-node
network per node (all its NICs), the host link (PCIe). The runtime constants (``layer_overhead_s``:
kernel launches per decoder layer and pass; ``decode_step_overhead_s``: the engine's scheduler and
sampler per decode step) are estimates on GPUs and measured on the CPU.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rlhf_hpc.config.errors import ConfigError, did_you_mean
from rlhf_hpc.config.registry import Registry
from rlhf_hpc.models.lora import lora_enabled
from rlhf_hpc.planning.sizing import DEFAULT_GPU_MEMORY_GB

__all__ = [
    "CALIBRATION_KEYS",
    "DEFAULT_GPU",
    "DEVICE_NAMES",
    "FIGURES",
    "Hardware",
    "PRESETS",
    "UNCALIBRATED_CPU",
    "calibration_path",
    "calibration_problems",
    "cpu_bf16_keys",
    "cpu_dtype_warnings",
    "cpu_has_native_bf16",
    "cpu_threads_per_rank",
    "device_hardware",
    "gpu_memory_gb",
    "hardware_of",
    "hardware_problems",
    "plans_this_cpu",
    "preset_for_device",
    "read_calibration",
    "register_hardware",
    "step_cpu_warning",
    "uncalibrated_cpu",
    "usable_cpus",
    "write_calibration",
]


@dataclass(frozen=True)
class Hardware:
    name: str
    bf16_tflops: float  # dense matmul peak, one GPU (one rank's cores on a CPU)
    fp32_tflops: float  # without tensor cores (fp32 matmuls as torch runs them by default)
    hbm_gb_s: float  # device memory bandwidth (host memory per rank on a CPU)
    hbm_gb: float  # device memory (the memory plan's default GPU size)
    intra_node_gb_s: float  # one GPU's link to the others of its node, one direction
    inter_node_gb_s: float  # the whole node's network, one direction
    host_link_gb_s: float  # host <-> device, one GPU (offloading)
    disk_gb_s: float = 2.0  # checkpoint writes, per node (a parallel file system's share)
    host_adam_params_s: float = 2e8  # AdamW parameters per second on the host cores of one rank
    layer_overhead_s: float = 2e-4  # per decoder layer and forward pass beside its FLOPs (kernel launches)
    pass_overhead_s: float = 2e-3  # per forward pass (embedding, head, Python, the loop's bookkeeping)
    # a routed (mixture-of-experts) layer's forward beside its FLOPs: the router's top-k, the tokens
    # sorted by expert and gathered, the experts' outputs combined; per expert it computes (a GPU's
    # grouped GEMM takes every expert in one kernel, a CPU's runs one matmul per expert) and per
    # (token, expert) pair routed. Estimates on GPUs, measured on the CPU (launch.py calibrate)
    routed_layer_overhead_s: float = 1e-4
    expert_overhead_s: float = 0.0
    routed_token_overhead_s: float = 0.0
    decode_step_overhead_s: float = 3e-3  # per decode step of the engine (scheduler, sampler, CUDA graph launch)
    request_overhead_s: float = 2e-4  # per request the engine takes (tokens in, a response out)
    generate_overhead_s: float = 5e-3  # per generate call
    # the weight sync's GPU figures are estimates nobody has measured for this project's in-place
    # streaming sync (NeMo-RL's published refits, another mechanism, take 5-12x: BENCHMARKS.md)
    sync_overhead_s: float = 0.5  # per weight sync beside its bytes (waking the engine's weights, bookkeeping)
    sync_param_overhead_s: float = 1e-4  # per trained parameter a sync gathers (FSDP's all-gather, buckets)
    sync_tensor_overhead_s: float = 2e-5  # per checkpoint tensor it sends (the engine's loader; one per expert matrix)
    collective_latency_s: float = 2e-5  # per collective call (NCCL launch; gloo's round trips on a CPU)
    engine_load_gb_s: float = 100.0  # bytes per second the engine's load_weights takes in
    cast_gb_s: float = 1000.0  # fp32 -> bf16 copies of the weight sync, source bytes per second
    # FLOP/s the engine's own kernels reach in prefill and decode (measured on the CPU); None: the
    # matmul peak x the time plan's PREFILL_EFFICIENCY
    prefill_fp32_tflops: Optional[float] = None
    prefill_bf16_tflops: Optional[float] = None
    decode_fp32_tflops: Optional[float] = None
    decode_bf16_tflops: Optional[float] = None
    # the share of the matmul peak a training pass reaches (on a GPU 0.4: what NeMo-RL's published
    # H100 runs imply, rlhf_hpc.planning.time_plan; on a CPU the calibration measures whole decoder
    # passes, so 1), and a backward's time over its forward's (2: twice the FLOPs)
    train_efficiency: float = 0.4
    backward_ratio: float = 2.0
    backward_ratio_fp32: float = 2.0
    overlap_comm: bool = True  # collectives run beside the compute (GPU copy engines; not gloo on the CPU cores)
    source: str = ""

    def engine_flops(self, stage: str, dtype: str) -> Optional[float]:
        """The engine's measured FLOP/s in ``stage`` (prefill, decode) and ``dtype``; None where not measured."""
        own = getattr(self, f"{stage}_{'fp32' if dtype in ('float32', 'fp32') else 'bf16'}_tflops")
        return own * 1e12 if own else None

    def backward(self, dtype: str) -> float:
        """A backward pass's time over its forward's in ``dtype``."""
        return self.backward_ratio_fp32 if dtype in ("float32", "fp32") else self.backward_ratio

    def matmul_flops(self, dtype: str) -> float:
        """Peak FLOP/s of one rank's matmuls in ``dtype`` (bf16 and fp16 use the tensor cores)."""
        return (self.bf16_tflops if dtype in ("bfloat16", "bf16", "float16", "fp16") else self.fp32_tflops) * 1e12


_NVIDIA = "NVIDIA datasheets: "
_AMD = "AMD datasheets: "
# The one table of GPU types: the time plan's and the memory plan's figures, and the MFU metric's
# peak (rlhf_hpc.observability.perf). Each entry names the substrings of torch.cuda.get_device_name
# it stands for; a new GPU type is one register_hardware call here (docs/extending.md).
PRESETS: Registry[Hardware] = Registry("GPU type", "hardware.preset")  # and "cpu": this machine's calibration
DEVICE_NAMES: dict[str, str] = {}  # a substring of the device name -> its preset
DEFAULT_GPU = "h100_sxm"  # a GPU run whose GPU is not named (nor known by its device name)


def register_hardware(name: str, hw: Hardware, device_names: tuple[str, ...] = ()) -> Hardware:
    """Add the preset ``name`` (``hardware.preset=name``), matched at run time by any of
    ``device_names`` in the GPU's name (the longest match wins: "H100 PCIe" over "H100")."""
    if name in PRESETS or name == "cpu":
        raise ValueError(f"hardware preset '{name}' is already registered")
    taken = [d for d in device_names if d in DEVICE_NAMES]
    if taken:
        raise ValueError(f"device name(s) {', '.join(taken)} already stand for another preset")
    PRESETS[name] = hw
    DEVICE_NAMES.update({d: name for d in device_names})
    return hw


# NVLink 4: 900 GB/s both directions per GPU; DGX H100: 8 x 400 Gb/s ConnectX-7 per node; PCIe Gen5 x16
register_hardware(
    "h100_sxm",
    Hardware(
        "H100 SXM 80GB",
        989,
        67,
        3350,
        80,
        450,
        400,
        64,
        source=_NVIDIA + "H100 Tensor Core GPU datasheet (SXM5), DGX H100 user guide",
    ),
    ("H100",),
)
# no NVLink across the node (bridges join pairs only): PCIe Gen5; 2 x 200 Gb/s NICs is a common build
register_hardware(
    "h100_pcie",
    Hardware(
        "H100 PCIe 80GB",
        756,
        51,
        2000,
        80,
        64,
        50,
        64,
        source=_NVIDIA + "H100 Tensor Core GPU datasheet (PCIe); PCIe Gen5 x16 between GPUs",
    ),
    ("H100 PCIe",),
)
register_hardware(
    "h200",
    Hardware(
        "H200 SXM 141GB",
        989,
        67,
        4800,
        141,
        450,
        400,
        64,
        source=_NVIDIA + "H200 Tensor Core GPU datasheet (SXM), DGX H200 user guide",
    ),
    ("H200",),
)
# NVLink 3: 600 GB/s both directions; DGX A100: 8 x 200 Gb/s HDR per node; PCIe Gen4 x16
register_hardware(
    "a100_80gb_sxm",
    Hardware(
        "A100 SXM 80GB",
        312,
        19.5,
        2039,
        80,
        300,
        200,
        32,
        source=_NVIDIA + "A100 Tensor Core GPU datasheet (80GB SXM), DGX A100 user guide",
    ),
    ("A100",),
)
register_hardware(
    "a100_80gb_pcie",
    Hardware(
        "A100 PCIe 80GB",
        312,
        19.5,
        1935,
        80,
        32,
        25,
        32,
        source=_NVIDIA + "A100 Tensor Core GPU datasheet (80GB PCIe); PCIe Gen4 x16 between GPUs",
    ),
    ("A100 80GB PCIe",),
)
# the 40 GB parts: HBM2 1555 GB/s, the same compute; torch names them "A100-SXM4-40GB" / "A100-PCIE-40GB"
register_hardware(
    "a100_40gb_sxm",
    Hardware(
        "A100 SXM 40GB",
        312,
        19.5,
        1555,
        40,
        300,
        200,
        32,
        source=_NVIDIA + "A100 Tensor Core GPU datasheet (40GB SXM), DGX A100 user guide",
    ),
    ("A100-SXM4-40GB",),
)
register_hardware(
    "a100_40gb_pcie",
    Hardware(
        "A100 PCIe 40GB",
        312,
        19.5,
        1555,
        40,
        32,
        25,
        32,
        source=_NVIDIA + "A100 Tensor Core GPU datasheet (40GB PCIe); PCIe Gen4 x16 between GPUs",
    ),
    ("A100-PCIE-40GB",),
)
# 362 dense (733 with sparsity), GDDR6 864 GB/s, no NVLink; 200 Gb/s per node is common
register_hardware(
    "l40s",
    Hardware(
        "L40S 48GB", 362, 91.6, 864, 48, 32, 25, 32, source=_NVIDIA + "L40S GPU datasheet; PCIe Gen4 x16 between GPUs"
    ),
    ("L40S",),
)
# 835 dense bf16, 60 fp32, HBM3 3.9 TB/s, 94 GB; NVLink bridges join pairs only (600 GB/s): PCIe Gen5
# across the node; the network as the PCIe card's
register_hardware(
    "h100_nvl",
    Hardware(
        "H100 NVL 94GB",
        835,
        60,
        3900,
        94,
        64,
        50,
        64,
        source=_NVIDIA + "H100 Tensor Core GPU datasheet (NVL); PCIe Gen5 x16 between GPUs",
    ),
    ("H100 NVL",),
)
# 181 dense bf16 (362 with sparsity), 90.5 fp32, GDDR6 864 GB/s, no NVLink; the network as the L40S's
register_hardware(
    "l40",
    Hardware(
        "L40 48GB", 181, 90.5, 864, 48, 32, 25, 32, source=_NVIDIA + "L40 GPU datasheet; PCIe Gen4 x16 between GPUs"
    ),
    ("L40",),
)
# 150 dense bf16 (299 with sparsity), 37.4 fp32, GDDR6 696 GB/s; NVLink bridges join pairs only
register_hardware(
    "a40",
    Hardware(
        "A40 48GB", 150, 37.4, 696, 48, 32, 25, 32, source=_NVIDIA + "A40 GPU datasheet; PCIe Gen4 x16 between GPUs"
    ),
    ("A40",),
)
# 155 dense bf16 (310 with sparsity), 38.7 fp32, GDDR6 768 GB/s; NVLink bridges join pairs only
register_hardware(
    "rtx_a6000",
    Hardware(
        "RTX A6000 48GB",
        155,
        38.7,
        768,
        48,
        32,
        25,
        32,
        source=_NVIDIA + "RTX A6000 datasheet; PCIe Gen4 x16 between GPUs",
    ),
    ("A6000",),
)
# no bf16: 125 is the fp16 tensor-core figure (the peak a bf16 run is measured against), 15.7 fp32,
# HBM2 900 GB/s, 32 GB (16 GB parts exist: hardware.hbm_gb=16); NVLink 2: 300 GB/s both directions;
# DGX-1: 4 x 100 Gb/s EDR per node; PCIe Gen3 x16
register_hardware(
    "v100",
    Hardware(
        "V100 SXM2 32GB",
        125,
        15.7,
        900,
        32,
        150,
        50,
        16,
        source=_NVIDIA + "V100 Tensor Core GPU datasheet (SXM2), DGX-1 user guide",
    ),
    ("V100",),
)
# 1307 dense bf16, 163.4 fp32 matrix, HBM3 5.3 TB/s, 192 GB; Infinity Fabric: 7 links of 64 GB/s one
# direction to the node's other GPUs; 8 x 400 Gb/s per node (the reference platform's); PCIe Gen5 x16
register_hardware(
    "mi300x",
    Hardware(
        "MI300X 192GB",
        1307,
        163.4,
        5300,
        192,
        448,
        400,
        64,
        source=_AMD + "AMD Instinct MI300X data sheet, MI300X platform data sheet",
    ),
    ("MI300X",),
)
# the package of two GCDs: 362 dense bf16, 90.5 fp32 matrix, HBM2e 3.2 TB/s, 128 GB (torch sees each GCD
# as a device with half of these: set hardware.* per GCD to plan one); Infinity Fabric up to 800 GB/s both
# directions; the network per node is not on the data sheet (4 x 200 Gb/s assumed); PCIe Gen4 x16
register_hardware(
    "mi250",
    Hardware(
        "MI250 128GB",
        362,
        90.5,
        3277,
        128,
        400,
        100,
        32,
        source=_AMD + "AMD Instinct MI250 data sheet (network per node assumed)",
    ),
    ("MI250",),
)

# a CPU without a calibration file: the order of magnitude of one modern core (a decoder pass at
# ~50 GFLOP/s in fp32, no native bf16), to be replaced by what `python launch.py calibrate` measures
UNCALIBRATED_CPU = Hardware(
    "CPU (uncalibrated)",
    0.01,
    0.05,
    10,
    0,
    5,
    1,
    10,
    disk_gb_s=0.5,
    train_efficiency=1.0,
    host_adam_params_s=5e7,
    layer_overhead_s=3e-4,
    pass_overhead_s=3e-3,
    routed_layer_overhead_s=3e-4,
    expert_overhead_s=3e-6,
    routed_token_overhead_s=5e-7,
    decode_step_overhead_s=1e-2,
    request_overhead_s=1e-3,
    generate_overhead_s=1e-2,
    sync_overhead_s=1e-2,
    collective_latency_s=1e-4,
    engine_load_gb_s=1.0,
    overlap_comm=False,
    source="nominal figures: no calibration file (run python launch.py calibrate)",
)


def uncalibrated_cpu(native_bf16: Optional[bool] = None) -> Hardware:
    """The nominal figures of a CPU without a calibration file, bf16 by the CPU's flags
    (``cpu_has_native_bf16``): with native bf16 it computes ~2x fp32 (BENCHMARKS.md, "bf16 on a CPU
    without native bf16"), without it the nominal fp32/5."""
    native = cpu_has_native_bf16() if native_bf16 is None else native_bf16
    if not native:
        return UNCALIBRATED_CPU
    return dataclasses.replace(
        UNCALIBRATED_CPU,
        bf16_tflops=2 * UNCALIBRATED_CPU.fp32_tflops,
        source=UNCALIBRATED_CPU.source + "; bf16 2x fp32: this CPU has native bf16",
    )


FIGURES = (
    "bf16_tflops",
    "fp32_tflops",
    "hbm_gb_s",
    "hbm_gb",
    "intra_node_gb_s",
    "inter_node_gb_s",
    "host_link_gb_s",
    "disk_gb_s",
)


def calibration_path() -> Path:
    """Where the calibration bench writes this machine's CPU figures (``RLHF_HPC_CACHE`` or
    ~/.cache/rlhf-hpc)."""
    return Path(os.environ.get("RLHF_HPC_CACHE", "~/.cache/rlhf-hpc")).expanduser() / "calibration" / "cpu.json"


# The calibration file: one JSON object of Hardware's figures by name (each optional: a missing one
# keeps the nominal CPU's) and "measured" (when and how: ranks, threads, cores, torch, date).
# Rates the plan divides by must be > 0; overheads, latencies and ratios >= 0 (a bench can measure
# nothing beside a pass); null only where Hardware's figure is Optional (not measured).
_RATE_ENDINGS = ("_tflops", "_gb_s", "_params_s")
CALIBRATION_KEYS: dict[str, str] = {
    f.name: (
        "bool"
        if f.type == "bool"
        else ("rate" if f.name.endswith(_RATE_ENDINGS) or f.name == "train_efficiency" else "nonnegative")
        + ("?" if f.type.startswith("Optional") else "")
    )
    for f in dataclasses.fields(Hardware)
    if f.name not in ("name", "source")
}  # (the reader names the source)
CALIBRATION_KEYS["measured"] = "mapping"
_JSON_TYPES = {
    dict: "an object",
    list: "an array",
    str: "a string",
    bool: "a boolean",
    type(None): "null",
    int: "a number",
    float: "a number",
}


def calibration_problems(figures, where: str) -> list[str]:
    """What is wrong with ``figures`` (a calibration file's parsed JSON) as the time plan reads them,
    one message per key, each starting with ``where`` (the key and the file)."""
    if not isinstance(figures, dict):
        return [
            f"{where} holds {_JSON_TYPES.get(type(figures), type(figures).__name__)}, not an object of named "
            f'figures ({{"fp32_tflops": 0.05, ...}})'
        ]
    out = []
    for k, v in figures.items():
        kind = CALIBRATION_KEYS.get(k)
        try:
            shown = json.dumps(v)
        except (TypeError, ValueError):  # not JSON (figures about to be written)
            shown = repr(v)
        given = f"{shown} ({_JSON_TYPES.get(type(v), type(v).__name__)})"
        number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if kind is None:
            out.append(f"{where}: unknown figure '{k}'{did_you_mean(k, CALIBRATION_KEYS)}")
        elif kind == "mapping" and not isinstance(v, dict):
            out.append(f"{where}: '{k}' is {given}; expected an object (ranks, threads_per_rank, cores, torch, date)")
        elif kind == "bool" and not isinstance(v, bool):
            out.append(f"{where}: '{k}' is {given}; expected true or false")
        elif kind in ("mapping", "bool") or (kind.endswith("?") and v is None):
            continue
        elif kind.startswith("rate") and not (number and v > 0):
            out.append(f"{where}: '{k}' is {given}; a rate the plan divides by must be a number > 0")
        elif kind.startswith("nonnegative") and not (number and v >= 0):
            out.append(f"{where}: '{k}' is {given}; expected a number >= 0")
    return out


def read_calibration(path: Optional[str] = None) -> Hardware:
    """The CPU figures of a calibration file (``path``; default ``calibration_path()``), per rank of
    one thread; the uncalibrated ones where no file is. A file that is not JSON, not an object, or
    holds an unknown key or a figure of the wrong type or sign is refused (ConfigError naming the
    file and the key, and how to write it again)."""
    p = Path(path).expanduser() if path else calibration_path()
    key = "hardware.calibration" + ("" if path else " (null: the default file)")
    fix = f"write it again with python launch.py calibrate --out {p}" + (
        "" if path else ", or delete it (the CPU plan then uses nominal figures)"
    )
    if not p.is_file():
        if path:
            raise ConfigError(
                f"hardware.calibration: no file {p}"
                f"{' (a directory)' if p.is_dir() else ''}; write it with python launch.py calibrate --out {p}"
            )
        return uncalibrated_cpu()
    try:
        figures = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:  # ValueError: json's JSONDecodeError
        raise ConfigError(f"{key}: {p} is not a JSON file ({type(e).__name__}: {e}); {fix}") from None
    problems = calibration_problems(figures, f"{key}: {p}")
    if problems:
        raise ConfigError([f"{m}; {fix}" for m in problems])
    return dataclasses.replace(
        UNCALIBRATED_CPU,
        **{k: v for k, v in figures.items() if k != "measured"},
        name=f"CPU rank ({figures.get('measured', {}).get('date', 'calibrated')} calibration)",
        source=f"measured by launch.py calibrate: {p}",
    )


def write_calibration(path: str | Path, figures: dict) -> Path:
    """Write ``figures`` where ``read_calibration`` reads them, refused (ConfigError) if it would
    refuse them. Atomic: the JSON goes to a temporary file in the same directory, flushed to disk,
    then renamed over ``path``, so a launch reading it meanwhile sees the old file or the new one,
    never a part (a write that fails leaves the old file as it was)."""
    p = Path(path).expanduser()
    problems = calibration_problems(figures, f"calibration figures for {p}")
    if problems:
        raise ConfigError(problems)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            json.dump(figures, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)  # (gone after the rename; a failed write's part)
    return p


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (a Slurm step bound to its cores, a
    cgroup), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return os.cpu_count() or 1


def cpu_threads_per_rank(ranks_per_node: int) -> int:
    """OMP threads a local CPU rank gets (rlhf_hpc.launch.local)."""
    return int(os.environ.get("OMP_NUM_THREADS") or max(1, usable_cpus() // max(ranks_per_node, 1)))


def step_cpu_warning(cpus_per_task: Optional[int], usable: int, slurm_cpus_per_task: Optional[str]) -> Optional[str]:
    """A node's job step that can use fewer CPUs than ``launcher.cpus_per_task`` asked for: its
    ranks, the engine's and NCCL's threads would share them."""
    if not cpus_per_task or usable >= cpus_per_task:
        return None
    return (
        f"this node's job step can use {usable} of the {cpus_per_task} CPUs launcher.cpus_per_task asks for "
        f"(SLURM_CPUS_PER_TASK={slurm_cpus_per_task or 'unset'}): the ranks, vLLM's and NCCL's threads share "
        f"them. The step's srun must restate --cpus-per-task (Slurm 22.05-23.11 steps do not inherit it); "
        f"the launcher's sbatch and slurm/klppo.sbatch do, so a site setting or a wrapper binds it smaller"
    )


def preset_for_device(device_name: str) -> Optional[str]:
    """The preset of a GPU as ``torch.cuda.get_device_name`` names it: the one whose longest device
    name is in it (None: not one of them)."""
    found = [d for d in DEVICE_NAMES if d in device_name]
    return DEVICE_NAMES[max(found, key=len)] if found else None


def device_hardware(device_name: str) -> Hardware:
    """The preset of a GPU by its name (``preset_for_device``), else the default GPU's."""
    return PRESETS[preset_for_device(device_name) or DEFAULT_GPU]


def plans_this_cpu(cfg) -> bool:
    """The time plan of ``cfg`` reads this machine's CPU calibration (``hardware_of``'s "cpu")."""
    return (cfg.hardware.preset or ("cpu" if cfg.trainer.device != "cuda" else "")) == "cpu"


def hardware_of(cfg, device_name: Optional[str] = None) -> Hardware:
    """The hardware ``cfg`` runs on: ``hardware.preset``, else the GPU's own (``device_name``, at
    run time), else h100_sxm for GPU runs and this CPU's calibration otherwise; with every figure
    ``hardware.<figure>`` sets on top."""
    hw_cfg = cfg.hardware
    cuda = cfg.trainer.device == "cuda"
    name = hw_cfg.preset or ((device_name and preset_for_device(device_name)) or DEFAULT_GPU if cuda else "cpu")
    if name == "cpu":
        hw = read_calibration(hw_cfg.calibration)
        threads = cpu_threads_per_rank(cfg.trainer.n_gpus_per_node)
        if threads > 1:  # the calibration is of one thread; matmuls scale with the cores a rank has
            hw = dataclasses.replace(hw, bf16_tflops=hw.bf16_tflops * threads, fp32_tflops=hw.fp32_tflops * threads)
    else:
        hw = PRESETS[name]
    given = {k: getattr(hw_cfg, k) for k in FIGURES if getattr(hw_cfg, k) is not None}
    if given:
        hw = dataclasses.replace(
            hw, **given, source=hw.source + "; set: " + ", ".join(f"{k}={v}" for k, v in given.items())
        )
    return hw


def gpu_memory_gb(cfg, device_gb: Optional[float] = None) -> tuple[float, str]:
    """(GiB of one GPU for the memory plan, where the figure comes from): ``hardware.hbm_gb`` (where
    the deprecated ``trainer.gpu_memory_gb`` is copied, rlhf_hpc.recipe.defaults), else a named
    preset's, else the GPU's own (``device_gb``: what a GPU rank reads from its device), else 80
    (H100 / A100 80GB: a plan made away from the GPUs)."""
    if cfg.hardware.hbm_gb:
        return cfg.hardware.hbm_gb, "hardware.hbm_gb"
    if cfg.hardware.preset in PRESETS:
        return PRESETS[cfg.hardware.preset].hbm_gb, f"hardware.preset={cfg.hardware.preset}"
    if device_gb:
        return device_gb, "this GPU's memory"
    return DEFAULT_GPU_MEMORY_GB, ""


def hardware_problems(cfg) -> list[str]:
    """A preset that is not known, a figure that is not positive, a calibration on a GPU run, a
    CPU run's calibration file that cannot be read (``read_calibration``)."""
    hw = cfg.hardware
    out = []
    if hw.preset is not None and hw.preset not in PRESETS and hw.preset != "cpu":
        out.append(
            f"hardware.preset: unknown '{hw.preset}'{did_you_mean(hw.preset, [*PRESETS, 'cpu'])}; known: "
            f"{', '.join([*PRESETS, 'cpu'])} (or leave it null and give the figures: "
            f"{', '.join('hardware.' + f for f in FIGURES)})"
        )
    for k in FIGURES:
        v = getattr(hw, k)
        if v is not None and v <= 0:
            out.append(f"hardware.{k}={v}: must be positive")
    cpu_plan = plans_this_cpu(cfg)
    if hw.calibration and not cpu_plan:
        out.append("hardware.calibration is the CPU's calibration file: it needs hardware.preset=cpu (a CPU run)")
    elif cpu_plan:  # the file the CPU plan reads: checked before the plan, not a traceback in it
        try:
            read_calibration(hw.calibration)
        except ConfigError as e:
            out += e.errors
    return out


# ------------------------------------------------------------------------------ bf16 on a CPU
# CPU feature flags (/proc/cpuinfo) of native bf16 arithmetic: x86 AVX-512 BF16 or AMX, Arm's BF16.
# Without them torch emulates bf16 matmuls (measured 18-20x slower than fp32 through a forward and
# backward pass: BENCHMARKS.md).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_has_native_bf16(cpuinfo: Optional[str] = None) -> Optional[bool]:
    """Whether this CPU computes bf16 natively, from the flags in ``cpuinfo`` (the text of
    /proc/cpuinfo; read when None). None where the flags cannot be read (not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, Arm
            flags.update(value.split())
    if not flags:
        return None
    return any(f in flags for f in NATIVE_BF16_FLAGS)


def cpu_bf16_keys(cfg) -> list[str]:
    """The config keys of the models this run computes in bf16 (the actor, the engine, and the
    reference, critic and reward model where the run has them)."""
    arr = cfg.actor_rollout_ref
    keys = {
        "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype": (
            arr.actor.fsdp_config.mixed_precision.param_dtype
        ),
        "actor_rollout_ref.rollout.dtype": arr.rollout.dtype,
    }
    if (arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and not lora_enabled(arr.model):
        # (with LoRA the reference is the actor with its adapter off: no model of its own)
        keys["actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype"] = (
            arr.ref.fsdp_config.mixed_precision.param_dtype
        )
    if cfg.critic.enable:
        keys["critic.model.fsdp_config.mixed_precision.param_dtype"] = (
            cfg.critic.model.fsdp_config.mixed_precision.param_dtype
        )
    if cfg.reward_model.enable:
        keys["reward_model.model.fsdp_config.mixed_precision.param_dtype"] = (
            cfg.reward_model.model.fsdp_config.mixed_precision.param_dtype
        )
    return [k for k, v in keys.items() if v == "bfloat16"]


def cpu_dtype_warnings(cfg, native_bf16: Optional[bool] = None) -> list[str]:
    """A CPU run computing in bf16 on a CPU without native bf16 (``cpu_has_native_bf16``; read here
    when None): the keys, and the float32 overrides that run it at full speed."""
    if cfg.trainer.device != "cpu":
        return []
    native = cpu_has_native_bf16() if native_bf16 is None else native_bf16
    keys = cpu_bf16_keys(cfg)
    if native is not False or not keys:
        return []
    return [
        f"this CPU has no native bf16 (no avx512_bf16/amx_bf16 in /proc/cpuinfo): torch emulates it, 18-20x "
        f"slower than float32 through a forward and backward pass (BENCHMARKS.md). The run computes in bf16 "
        f"through {', '.join(keys)}; to run in "
        f"float32 add: {' '.join(k + '=float32' for k in keys)}"
    ]
