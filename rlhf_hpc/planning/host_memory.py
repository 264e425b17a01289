"""Host memory of one node, the memory plan's last line (rlhf_hpc.planning.memory_plan): each rank's
runtime and what it offloads to the host (on a CPU run, its whole per-rank plan), and the copy of a
pretrained checkpoint rank 0 reads at start-up (rlhf_hpc.distributed.loading), checked against
``launcher.mem_gb`` before anything is queued.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from rlhf_hpc.config.engines import planned_engine
from rlhf_hpc.config.schema import Config, FSDPConfig
from rlhf_hpc.distributed.host_allocator import TUNABLES, VALUE, malloc_tunables
from rlhf_hpc.models.lora import lora_enabled, vllm_lora_rank
from rlhf_hpc.planning.layout import shard_count
from rlhf_hpc.planning.sizing import (
    DTYPE_BYTES,
    GiB,
    ModelShape,
    engine_weight_segments,
    pinned_bytes,
    pinned_shard_bytes,
)

__all__ = [
    "HOST_RUNTIME_GB",
    "EngineSleepCopy",
    "HostPlan",
    "engine_sleep_copy",
    "host_plan",
    "host_runtime_bytes",
    "offloaded_bytes",
]

# host memory of a rank apart from tensors: Python with torch, transformers and vLLM imported
# (measured: 0.5 GiB resident on the CPU build); a GPU rank adds its CUDA context and NCCL's and
# vLLM's host-side buffers (an estimate, 3 GiB in all: not measured here)
HOST_RUNTIME_GB = {"cpu": 0.5, "cuda": 3.0}


@dataclass
class HostPlan:
    """Host memory of one node: every rank's steady share (``per_rank``: its runtime, what is
    offloaded to the host; on a CPU run its whole per-rank plan) and the start-up peak of reading
    a pretrained checkpoint (rank 0 alone holds a full copy, rlhf_hpc.distributed.loading)."""

    ranks: int
    per_rank: dict[str, float]
    loading: float  # one full copy of the largest pretrained model, in its model_dtype
    capacity: Optional[float]  # bytes per node: launcher.mem_gb, or this machine's memory when local
    capacity_source: str = ""
    shrink: list[str] = field(default_factory=list)
    enforced: bool = False  # the capacity is the job's limit (launcher.mem_gb): above it is an error

    @property
    def total(self) -> float:
        return self.ranks * sum(self.per_rank.values()) + self.loading

    def _detail(self) -> str:
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.per_rank.items() if v)
        return f"{self.ranks} ranks x {sum(self.per_rank.values()) / GiB:.2f} ({parts})" + (
            f" + loading {self.loading / GiB:.2f} (rank 0 reads the checkpoint)" if self.loading else ""
        )

    def render(self) -> str:
        fits = self.capacity is None or self.total <= self.capacity
        line = f"{'# OK  ' if fits else '# FAIL'} host/node     {self.total / GiB:6.1f} GiB  = {self._detail()}"
        return line + (
            f" of {self.capacity / GiB:.0f} GiB ({self.capacity_source})"
            if self.capacity
            else " (no launcher.mem_gb to check against)"
        )

    def failure(self) -> Optional[str]:
        if self.capacity is None or self.total <= self.capacity:
            return None
        return (
            f"memory plan: host memory per node needs {self.total / GiB:.1f} GiB but {self.capacity_source} "
            f"gives {self.capacity / GiB:.0f} GiB ({self._detail()}); shrink it with {', '.join(self.shrink)}"
        )


def host_runtime_bytes(device: str) -> float:
    """A rank's host memory beside its tensors: the libraries (``HOST_RUNTIME_GB``) and, on CPU
    ranks started with the launcher's malloc settings (rlhf_hpc.distributed.host_allocator), the freed heap
    malloc keeps for reuse (up to its trim threshold)."""
    # (the launcher decides from its own environment; a rank it started has the value set)
    tuned = os.environ.get("GLIBC_TUNABLES") == VALUE or malloc_tunables(os.environ)[0] is not None
    kept = TUNABLES["glibc.malloc.trim_threshold"] if device != "cuda" and tuned else 0
    return HOST_RUNTIME_GB["cuda" if device == "cuda" else "cpu"] * GiB + kept


def offloaded_bytes(
    fsdp: FSDPConfig,
    params: float,
    trained: float,
    trains: bool,
    rows: tuple[tuple[int, int], ...] = (),
    shards: int = 1,
    lora: bool = False,
) -> float:
    """Host bytes one GPU rank holds for a model offloaded by ``fsdp`` (``params`` and ``trained``:
    its shard's parameters and trained ones; ``rows``: the model's tensors, ``ModelShape.rows_with_head``).

    - ``param_offload`` (FSDP2's CPUOffloadPolicy): the parameter shards and, training, their
      gradients (copied back without blocking) in pinned memory, one allocation per tensor, each
      rounded up to a power of two (``pinned_shard_bytes``); Adam's moments, made by the optimizer
      beside the parameters, in ordinary memory.
    - ``optimizer_offload``: Adam's two fp32 moments, sent to the host after each update by a
      non-blocking copy (``rlhf_hpc.ppo.optim``): pinned, rounded the same way.

    A LoRA model's trained tensors (its adapter) are counted at their bytes, and so is a model
    whose tensors are not known (``rows`` empty)."""
    dtype = DTYPE_BYTES[fsdp.model_dtype]

    def pinned(element_bytes: int, count: float) -> float:
        return pinned_shard_bytes(rows, shards, element_bytes) if rows else count * element_bytes

    if fsdp.param_offload or fsdp.offload_policy:
        if not trains:
            return pinned(dtype, params)
        grads = trained * dtype if lora else pinned(dtype, trained)
        return pinned(dtype, params) + grads + 8 * trained
    if trains and fsdp.optimizer_offload:
        return 8 * trained if lora else 2 * pinned(4, trained)
    return 0.0


@dataclass
class EngineSleepCopy:
    """What a colocated vLLM engine's sleep moves on one GPU rank: ``copied`` bytes to the host at
    each sleep and back at the next wake; ``pinned``, the host memory its buffers hold."""

    copied: float
    pinned: float


def engine_sleep_copy(cfg: Config, shape: ModelShape, adapter_params: int = 0) -> Optional[EngineSleepCopy]:
    """The colocated vLLM engine's sleep mode on GPU ranks (``rollout.free_cache_engine``;
    rlhf_hpc.rollout.vllm_engine.release), per rank; None where nothing of note is copied.

    A LoRA actor's engine sleeps at level 1 (the base weights must survive): vLLM copies every
    device segment of its weights (``engine_weight_segments``) and its adapter slots to the host,
    one synchronous copy per allocation into a pinned buffer rounded up to a power of two, and back
    at the wake; the buffers stay cached in the process between steps. At level 2 (a full model: the
    next sync overwrites every weight) only the engine's runtime pool (block tables, attention
    metadata) and the model's buffers (the rotary cache) go and come back: tens of MiB, below this
    plan's resolution. The KV cache is dropped at both levels, never copied; the CUDA-graph pool stays
    on the GPU. (vLLM 0.33: device_allocator/cumem.py ``sleep``/``wake_up``; v1/worker/gpu_worker.py.)"""
    arr = cfg.actor_rollout_ref
    rollout = arr.rollout
    if (
        cfg.trainer.device != "cuda"
        or cfg.split
        or not (lora_enabled(arr.model) and planned_engine(rollout.name).paged and rollout.free_cache_engine)
    ):
        return None
    element, tp = DTYPE_BYTES[rollout.dtype], rollout.tensor_model_parallel_size
    segments = engine_weight_segments(shape, tp, element)
    # the adapter's slots at the rank vLLM is given (rounded up as verl does), one adapter at a time;
    # many small tensors, counted at their bytes
    rank = arr.model.lora_rank
    slots = adapter_params * (vllm_lora_rank(rank) / rank if rank else 1) * element / tp
    return EngineSleepCopy(sum(segments) + slots, pinned_bytes(segments) + slots)


def host_plan(
    cfg: Config,
    actor_params: int,
    peak: float,
    largest_pretrained: int,
    critic_params: int,
    rm_params: int,
    layouts: dict[str, Optional[FSDPConfig]],
    trainable: Optional[dict] = None,
    shapes: Optional[dict[str, Optional[ModelShape]]] = None,
) -> HostPlan:
    """Host memory of one node (``HostPlan``). GPU runs: each rank's runtime and the shards offloaded
    to the host (``param_offload``: parameters, gradients and Adam's moments; ``optimizer_offload``:
    the moments between updates), and a LoRA actor's engine weights while it sleeps; CPU runs: the
    per-rank plan's largest phase (``peak``), which is host memory already. Plus the start-up copy
    rank 0 reads (``largest_pretrained`` parameters). ``trainable``: a LoRA model's adapter
    parameters by model name (gradients and moments are of those only). ``shapes``: the models'
    shapes by name, whose tensors give what pinned memory holds (``offloaded_bytes``)."""
    tr, world = cfg.trainer, cfg.world_size
    params = {"actor": actor_params, "ref": actor_params, "critic": critic_params, "reward_model": rm_params}
    shrink = []
    if tr.device == "cuda":
        per_rank = {"runtime": host_runtime_bytes("cuda")}
        for name, fsdp in layouts.items():
            if fsdp is None:
                continue
            n = params[name] / shard_count(world, fsdp)
            trains = name in ("actor", "critic")
            t = ((trainable or {}).get(name) or params[name]) / shard_count(world, fsdp)
            prefix = {
                "actor": "actor_rollout_ref.actor",
                "ref": "actor_rollout_ref.ref",
                "critic": "critic.model",
                "reward_model": "reward_model.model",
            }[name]
            shape = (shapes or {}).get(name)
            rows = shape.rows_with_head("value" if name == "critic" else "lm") if shape is not None else ()
            lora = (trainable or {}).get(name) is not None
            held = offloaded_bytes(fsdp, n, t, trains, rows, shard_count(world, fsdp), lora)
            if fsdp.param_offload or fsdp.offload_policy:
                per_rank[f"{name} offloaded"] = held
                shrink.append(f"{prefix}.fsdp_config.param_offload=false")
            elif held:
                per_rank[f"{name} Adam moments"] = held
                shrink.append(f"{prefix}.fsdp_config.optimizer_offload=false")
        actor_shape = (shapes or {}).get("actor")
        asleep = engine_sleep_copy(cfg, actor_shape, (trainable or {}).get("actor") or 0) if actor_shape else None
        if asleep is not None:
            per_rank["engine asleep (LoRA)"] = asleep.pinned
            shrink.append(
                "actor_rollout_ref.rollout.tensor_model_parallel_size (each rank's engine holds 1/TP of the weights)"
            )
    else:
        per_rank = {"largest phase": peak}
    loading = float(largest_pretrained * DTYPE_BYTES[cfg.actor_rollout_ref.actor.fsdp_config.model_dtype])
    if loading:
        shrink.append("actor_rollout_ref.actor.fsdp_config.model_dtype=bfloat16 (the copy rank 0 reads)")
    shrink += ["trainer.n_gpus_per_node (fewer ranks per node, more nodes)"]
    capacity, source = None, ""
    if cfg.launcher.mem_gb:
        capacity, source = cfg.launcher.mem_gb * GiB, "launcher.mem_gb"
        shrink.insert(0, "launcher.mem_gb (ask Slurm for more)")
    elif cfg.launcher.cluster == "local" or tr.device != "cuda":
        capacity, source = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine"
    return HostPlan(cfg.procs_per_node, per_rank, loading, capacity, source, shrink, enforced=bool(cfg.launcher.mem_gb))
