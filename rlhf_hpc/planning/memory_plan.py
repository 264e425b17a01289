"""The per-GPU memory plan: what each phase of a step holds on one GPU, from the config alone.

Printed at ``--dry-run`` and checked before anything is queued: a plan that cannot fit is refused
with the keys that shrink the failing phase. No weights are loaded: the model's shape comes from
its ``config.json`` (built on the meta device to count parameters), or, where the model directory
is not on this machine, from the published config of a known model.

Phases of one colocated step (one rank = one GPU):

- ``gen``: vLLM holds ``gpu_memory_utilization`` x GPU memory (its weights, activations and KV cache);
  what training keeps on the GPU between phases (shards that are not offloaded) must fit beside it;
- ``old_log_prob`` / ``ref`` / ``values`` / ``reward_model``: forward passes, no graph (vLLM asleep);
- ``update_actor`` / ``update_critic``: sharded parameters, gradients, optimizer state, the
  unsharded group FSDP is computing, activations of one micro-batch, the logits.

Estimates (bytes per token per decoder layer, logits) follow what the code keeps alive; they are
checked on CPU against measured peaks (``python -m benchmarks.memory_plan_check``, BENCHMARKS.md)
and on a GPU against ``torch.cuda.max_memory_allocated`` (``rlhf_hpc.hardware_checks.gpu_check``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from rlhf_hpc.config.engines import planned_engine
from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.schema import Config, FSDPConfig
from rlhf_hpc.models.hf import is_tiny
from rlhf_hpc.models.lora import lora_enabled
from rlhf_hpc.ops.step_shape import PhaseShape, step_shape
from rlhf_hpc.planning.hardware import gpu_memory_gb
from rlhf_hpc.planning.host_memory import HostPlan, host_plan, host_runtime_bytes, offloaded_bytes
from rlhf_hpc.planning.layout import (
    choose_checkpointing,
    resolved_fsdp_configs,
    shard_count,
)
from rlhf_hpc.planning.layout import (
    describe as describe_layouts,
)
from rlhf_hpc.planning.sizing import (
    DEFAULT_GPU_MEMORY_GB,
    DTYPE_BYTES,
    GiB,
    ModelShape,
    activation_bytes,
    adapter_params,
    logits_bytes,
    model_shape,
)

__all__ = [
    "MEMORY_KEYS",
    "VLLM_CPU_RUNTIME_GB",
    "MemoryPlan",
    "Phase",
    "PlanBuilder",
    "build_plan",
    "check_plan",
    "cpu_kv_cache_bytes",
    "kv_bytes_per_token",
    "oom_message",
    "update_bytes",
    "update_keys",
]

RUNTIME_GB = 1.0  # CUDA context, NCCL buffers, allocator slack: held in every phase
CUDA_GRAPHS_GB = 1.0  # vLLM's captured CUDA graphs (enforce_eager=false)
# vLLM's CPU build beside its weights and KV space: scheduler, sampler and attention buffers, the warm-up's
# freed heap (SmolLM2-135M fp32: engine start takes 2.03 GiB above the import, weights + KV space are 1.5)
VLLM_CPU_RUNTIME_GB = 0.5
# the most KV cache a CPU vLLM engine gets unless VLLM_CPU_KVCACHE_SPACE says otherwise
VLLM_CPU_KV_CACHE_MAX_GB = 1


def kv_bytes_per_token(s: ModelShape, dtype_bytes: int, tp: int) -> float:
    """One token's keys and values on one rank of a tensor-parallel group of ``tp``."""
    return 2 * s.layers * s.kv_heads * s.head_dim * dtype_bytes / min(tp, s.kv_heads)


def cpu_kv_cache_bytes(max_num_seqs: int, max_len: int, kv_per_token: float) -> int:
    """A CPU vLLM engine's KV cache (one rank): ``VLLM_CPU_KVCACHE_SPACE`` GiB where set, else room for
    ``max_num_seqs`` sequences of ``max_len`` tokens (in the engine's 32-token blocks: all it runs at once), at
    most VLLM_CPU_KV_CACHE_MAX_GB. A fixed 1 GiB whatever the model was most of a tiny model's engine
    start here: the pages are touched as it is made (BENCHMARKS.md, "The test suite's time")."""
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if space:
        return int(space) * GiB
    need = max_num_seqs * -(-max_len // 32) * 32 * kv_per_token
    return int(min(need, VLLM_CPU_KV_CACHE_MAX_GB * GiB))


# ------------------------------------------------------------------------------------ estimates
@dataclass
class Phase:
    name: str
    parts: dict[str, float] = field(default_factory=dict)  # bytes
    shrink: list[str] = field(default_factory=list)  # keys that make this phase smaller
    note: str = ""

    @property
    def total(self) -> float:
        return sum(self.parts.values())


@dataclass
class MemoryPlan:
    device: str
    capacity: float  # bytes per GPU
    phases: list[Phase]
    shape: ModelShape
    kv_cache_tokens: Optional[int] = None
    max_model_len: int = 0
    notes: list[str] = field(default_factory=list)
    host: Optional[HostPlan] = None
    capacity_source: str = ""  # where the GPU's size comes from (rlhf_hpc.planning.hardware.gpu_memory_gb)

    def failures(self) -> list[str]:
        """What cannot fit: a GPU phase above the GPU's memory, a KV cache smaller than one
        sequence (GPU runs); the node's host memory above ``launcher.mem_gb`` (any run)."""
        out = []
        if self.device == "cuda":
            for p in self.phases:
                if p.total > self.capacity:
                    out.append(
                        f"memory plan: phase {p.name} needs {p.total / GiB:.1f} GiB per GPU but a GPU has "
                        f"{self.capacity / GiB:.0f} GiB "
                        f"({', '.join(f'{k} {v / GiB:.1f}' for k, v in p.parts.items() if v)}); "
                        f"shrink it with {', '.join(p.shrink)}"
                    )
            if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.max_model_len:
                out.append(
                    f"memory plan: phase gen leaves room for a KV cache of {max(self.kv_cache_tokens, 0)} tokens "
                    f"per GPU, less than one sequence (max_model_len {self.max_model_len}); raise "
                    f"actor_rollout_ref.rollout.gpu_memory_utilization or "
                    f"actor_rollout_ref.rollout.tensor_model_parallel_size, or shorten "
                    f"data.max_prompt_length / data.max_response_length"
                )
        problem = self.host.failure() if self.host is not None and self.host.enforced else None
        return out + ([problem] if problem else [])

    def warnings(self) -> list[str]:
        """The node's host memory above this machine's (a local run: the estimate is no limit the
        job is held to, so it warns)."""
        if self.host is None or self.host.enforced:
            return []
        problem = self.host.failure()
        return [problem] if problem else []

    @property
    def peak(self) -> float:
        """The largest phase, bytes per GPU (per rank on the host for a CPU run)."""
        return max(p.total for p in self.phases)

    def against_measured(self, peaks: dict[str, float]) -> list[tuple[str, float, float]]:
        """(phase, planned GiB, measured GiB) for each phase a run measured: ``peaks`` holds
        ``memory_gb/<phase>`` (rlhf_hpc.observability.perf.Timer, the largest rank's). A GPU's measurement is
        ``max_memory_allocated``, tensors only, so there the plan's runtime part (CUDA context,
        NCCL buffers) is left out of the planned figure; on the CPU both count the whole process."""
        out = []
        for p in self.phases:
            measured = peaks.get(f"memory_gb/{p.name}")
            if measured is None:
                continue
            planned = p.total - (p.parts.get("runtime", 0.0) if self.device == "cuda" else 0.0)
            out.append((p.name, planned / GiB, measured))
        return out

    def render_measured(self, peaks: dict[str, float]) -> Optional[str]:
        """One line: each measured phase's peak against the plan, with the ratio."""
        rows = self.against_measured(peaks)
        if not rows:
            return None
        what = "max_memory_allocated vs plan less runtime" if self.device == "cuda" else "peak RSS vs plan"
        return f"memory per phase, measured on the largest rank ({what}), GiB: " + ", ".join(
            f"{name} {m:.2f}/{p:.2f} ({m / p:.2f}x)" if p > 0 else f"{name} {m:.2f}/0" for name, p, m in rows
        )

    def render(self) -> str:
        gb = lambda b: f"{b / GiB:6.1f}"  # noqa: E731
        where = "GPU" if self.device == "cuda" else "rank (host memory)"
        lines = [
            f"# memory plan per {where}: {self.capacity / GiB:.0f} GiB"
            + (f" ({self.capacity_source or 'assumed'})" if self.device == "cuda" else ""),
            f"# model: {self.shape.params / 1e9:.3g}B parameters"
            + (
                f" ({self.shape.active_params / 1e9:.3g}B active: {self.shape.experts_per_token} of "
                f"{self.shape.experts} experts per token; weights, gradients and optimizer state hold all, "
                f"activations and FLOPs the active)"
                if self.shape.experts
                else ""
            )
            + f", {self.shape.source}",
        ]
        for p in self.phases:
            flag = "# OK  " if p.total <= self.capacity else "# FAIL"
            parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in p.parts.items() if v)
            lines.append(f"{flag} {p.name:<14}{gb(p.total)} GiB  = {parts}" + (f"  [{p.note}]" if p.note else ""))
        if self.kv_cache_tokens is not None:
            lines.append(
                f"#       KV cache room: {max(self.kv_cache_tokens, 0):,} tokens per GPU "
                f"(one sequence: {self.max_model_len})"
            )
        if self.host is not None:
            lines.append(self.host.render())
        lines += [f"# {n}" for n in self.notes]
        return "\n".join(lines)


def _train_state(
    params: int, fsdp: FSDPConfig, world: int, phase: str, trainable: Optional[int] = None
) -> dict[str, float]:
    """Sharded parameters, gradients and Adam state on the GPU in ``phase`` (gen, forward, update).
    With param_offload (FSDP2 CPUOffloadPolicy) all three live on the host; optimizer_offload alone
    moves the Adam state to the host between updates (optim.optimizer_state_on). ``trainable``: the
    parameters with gradients and Adam state (a LoRA adapter's); default all."""
    shards = shard_count(world, fsdp)
    trainable = params if trainable is None else trainable
    master = DTYPE_BYTES[fsdp.model_dtype]
    host_params = fsdp.param_offload or fsdp.offload_policy
    out = {"params": 0.0 if host_params else params * master / shards}
    if phase == "update":
        out["grads"] = 0.0 if host_params else trainable * master / shards
    optim_on_gpu = not host_params and (phase == "update" or not fsdp.optimizer_offload)
    out["optimizer"] = 2 * trainable * 4 / shards if optim_on_gpu else 0.0
    return out


def _working(s: ModelShape, fsdp: FSDPConfig, with_grad: bool) -> float:
    """The group FSDP all-gathered for compute (and the next one when prefetching); in backward its
    gradient in the compute dtype and the reduce-scatter buffer (``with_grad`` False for a LoRA
    model too: its frozen base has none, its adapter's are counted in ``grads``)."""
    b = DTYPE_BYTES[fsdp.mixed_precision.param_dtype]
    # without reshard_after_forward every group stays unsharded from its forward to its backward
    gathered = s.largest_group if fsdp.reshard_after_forward is not False else s.params
    out = gathered * b + (s.layer_params * b if fsdp.forward_prefetch else 0)
    if with_grad:
        out += s.largest_group * (b + DTYPE_BYTES[fsdp.mixed_precision.reduce_dtype])
    return float(out)


def update_bytes(
    s: ModelShape,
    params: int,
    fsdp: FSDPConfig,
    world: int,
    tokens: int,
    response_tokens: int,
    checkpointing: bool,
    head_vocab: int,
    trainable: Optional[int] = None,
) -> dict[str, float]:
    """One model's own share of an update phase: its training state, the unsharded group, the
    activations of a micro-batch of ``tokens`` (``response_tokens`` of them scored by a head of
    ``head_vocab`` logits; 0: a value head, one number per token). ``trainable``: a LoRA model's
    adapter parameters (the rest frozen)."""
    b = DTYPE_BYTES[fsdp.mixed_precision.param_dtype]
    return {
        **_train_state(params, fsdp, world, "update", trainable),
        "unsharded group": _working(s, fsdp, with_grad=trainable is None),
        "activations": activation_bytes(s, tokens, b, checkpointing, True),
        "logits": float(logits_bytes(response_tokens, head_vocab, b, with_grad=True)) if head_vocab else tokens * 8.0,
    }


def _adapter_params(key: str, path: str, lora_cfg, override: dict, trust_remote_code: bool) -> int:
    """``adapter_params``, with PEFT's refusal of the adapter (no module matches ``target_modules``,
    an adapter of another model) as a ConfigError naming the key, not a traceback."""
    try:
        return adapter_params(path, lora_cfg, override, trust_remote_code)
    except ValueError as e:  # PEFT's NoMatchingPeftModuleError and its other refusals of a target
        where = (
            f"{key}.lora_adapter_path={lora_cfg.lora_adapter_path}"
            if getattr(lora_cfg, "lora_adapter_path", None)
            else f"{key}.target_modules={lora_cfg.target_modules}"
        )
        raise ConfigError(f"{where}: {' '.join(str(e).split())}") from None


def build_plan(
    cfg: Config,
    shape: Optional[ModelShape] = None,
    critic_shape: Optional[ModelShape] = None,
    rm_shape: Optional[ModelShape] = None,
    device_gb: Optional[float] = None,
) -> MemoryPlan:
    """The plan of ``cfg``: its phases in step order (``PlanBuilder``), the host's line, notes.
    ``device_gb``: the GPU's own memory, where a GPU rank plans (``hardware.gpu_memory_gb``)."""
    return PlanBuilder(cfg, shape, critic_shape, rm_shape, device_gb).build()


class PlanBuilder:
    """What the phases of one plan share (the shapes, layouts, capacity, what stays resident), and
    one method per kind of phase: generation, a forward pass, an update."""

    def __init__(
        self,
        cfg: Config,
        shape: Optional[ModelShape],
        critic_shape: Optional[ModelShape],
        rm_shape: Optional[ModelShape],
        device_gb: Optional[float] = None,
    ):
        arr, tr = cfg.actor_rollout_ref, cfg.trainer
        self.cfg, self.world = cfg, cfg.world_size
        self.s = shape or model_shape(arr.model.path, arr.model.override_config, arr.model.trust_remote_code)
        self.on_gpu = tr.device == "cuda"
        self.capacity_source = ""
        if self.on_gpu:
            gb, self.capacity_source = gpu_memory_gb(cfg, device_gb)
            self.capacity = gb * GiB
        else:  # informational: the host's memory shared by the ranks of a node
            self.capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(cfg.procs_per_node, 1)
        self.runtime = RUNTIME_GB * GiB if self.on_gpu else host_runtime_bytes(tr.device)
        self.step = step_shape(cfg)
        self.P, self.R, self.per_rank_rows = self.step.prompt_len, self.step.response_len, self.step.rows_per_rank
        self.use_critic = bool(cfg.critic.enable)
        self.cs = critic_shape or self.s
        self.critic_params = self.cs.params - self.cs.head_params + self.cs.hidden + 1 if self.use_critic else 0
        self.use_ref = arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        # LoRA: gradients and Adam state of the adapters only; the reference is the actor, adapter off
        self.actor_trainable = (
            _adapter_params(
                "actor_rollout_ref.model",
                arr.model.path,
                arr.model,
                arr.model.override_config,
                arr.model.trust_remote_code,
            )
            if lora_enabled(arr.model)
            else None
        )
        self.critic_trainable = (
            _adapter_params(
                "critic.model",
                cfg.critic.model.path or arr.model.path,
                cfg.critic.model,
                cfg.critic.model.override_config,
                bool(cfg.critic.model.trust_remote_code),
            )
            + self.cs.hidden
            + 1
            if self.use_critic and lora_enabled(cfg.critic.model)
            else None
        )
        self.ref_in_actor = self.use_ref and lora_enabled(arr.model)
        layouts = resolved_fsdp_configs(cfg)  # null layouts chosen from the model size (rlhf_hpc.planning.layout)
        self.recompute = {name: on for name, (on, _) in choose_checkpointing(cfg).items()}
        self.afs, self.rfs, self.cfs = layouts["actor"], layouts["ref"], layouts["critic"]
        if self.ref_in_actor:
            self.rfs = self.afs  # the reference's forward is the actor's, on its mesh
        self.notes = describe_layouts(cfg)
        rm = cfg.reward_model
        self.rms = None
        if rm.enable:
            try:
                self.rms = rm_shape or model_shape(rm.model.path, rm.model.override_config, rm.model.trust_remote_code)
            except FileNotFoundError as e:
                self.notes.append(f"reward model left out of the plan: {e}")
        self.rm_params = self.rms.params - self.rms.head_params + self.rms.hidden if self.rms else 0  # + 1-label head
        self.mfs = rm.model.fsdp_config
        self.phases: list[Phase] = []
        self.kv_tokens: Optional[int] = None

    def build(self) -> MemoryPlan:
        cfg, s = self.cfg, self.s
        arr, tr, critic, rm = cfg.actor_rollout_ref, cfg.trainer, cfg.critic, cfg.reward_model
        rollout = arr.rollout
        self.gen_phase()
        if self.step.old_log_probs == "pass":  # (else no old-log-prob pass runs: ops.step_shape)
            self.forward_phase(
                "old_log_prob",
                s,
                self.afs,
                s.vocab,
                [
                    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
                ],
            )
        if self.use_ref:
            self.forward_phase(
                "ref",
                s,
                self.rfs,
                s.vocab,
                [
                    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
                ],
            )
        if self.use_critic:
            self.forward_phase(
                "values",
                self.cs,
                self.cfs,
                0,
                ["critic.ppo_micro_batch_size_per_gpu", "critic.forward_max_token_len_per_gpu"],
            )
        if self.rms:
            self.forward_phase(
                "reward_model",
                self.rms,
                self.mfs,
                0,
                [
                    "reward_model.micro_batch_size_per_gpu",
                    "reward_model.forward_max_token_len_per_gpu",
                    *offload_keys("reward_model.model", self.mfs, optimizer=False),
                ],
            )
        self.update_phase(
            "update_actor", s, s.params, self.afs, self.recompute["actor"], s.vocab, "actor", self.actor_trainable
        )
        if self.use_critic:
            self.update_phase(
                "update_critic",
                self.cs,
                self.critic_params,
                self.cfs,
                self.recompute["critic"],
                0,
                "critic",
                self.critic_trainable,
            )
        notes = self.notes
        if self.on_gpu and not self.capacity_source:
            notes.append(
                f"GPU memory assumed {DEFAULT_GPU_MEMORY_GB:.0f} GiB: set hardware.hbm_gb or "
                f"hardware.preset for other GPUs"
            )
        afs = self.afs
        if afs.param_offload or afs.optimizer_offload:
            trained = s.params if self.actor_trainable is None else self.actor_trainable
            shards = shard_count(self.world, afs)
            rows = s.rows_with_head() if self.on_gpu else ()  # (pinned memory: GPU runs only)
            host = offloaded_bytes(
                afs, s.params / shards, trained / shards, True, rows, shards, self.actor_trainable is not None
            )
            notes.append(
                f"actor offload: ~{host / GiB:.1f} GiB of host memory per rank"
                + (" (optimizer.step runs on the CPU)" if afs.param_offload else "")
            )
        max_len = rollout.max_model_len or (self.P + self.R)
        plan = MemoryPlan(
            tr.device,
            self.capacity,
            self.phases,
            s,
            self.kv_tokens,
            max_len,
            notes,
            capacity_source=self.capacity_source,
        )
        pretrained = [
            shp
            for shp, path in (
                (s, arr.model.path),
                (self.cs if self.use_critic else None, critic.model.path),
                (self.rms, rm.model.path),
            )
            if shp is not None and not is_tiny(path)
        ]
        plan.host = host_plan(
            cfg,
            s.params,
            plan.peak,
            max((x.params for x in pretrained), default=0),
            self.critic_params,
            self.rm_params,
            {
                "actor": afs,
                "ref": self.rfs if self.use_ref and not self.ref_in_actor else None,
                "critic": self.cfs if self.use_critic else None,
                "reward_model": self.mfs if self.rms else None,
            },
            {"actor": self.actor_trainable, "critic": self.critic_trainable},
            {"actor": s, "ref": s, "critic": self.cs if self.use_critic else None, "reward_model": self.rms},
        )
        return plan

    def resident(self, phase: str, skip: str = "") -> dict[str, float]:
        """What the other models keep on the GPU during ``phase``."""
        s, world, out = self.s, self.world, {}
        if skip != "actor":
            out["actor state"] = sum(_train_state(s.params, self.afs, world, phase, self.actor_trainable).values())
        if self.use_ref and not self.ref_in_actor and skip != "ref":
            rfs = self.rfs
            out["ref params"] = (
                0.0
                if rfs.param_offload or rfs.offload_policy
                else s.params * DTYPE_BYTES[rfs.model_dtype] / shard_count(world, rfs)
            )
        if self.use_critic and skip != "critic":
            out["critic state"] = sum(
                _train_state(self.critic_params, self.cfs, world, phase, self.critic_trainable).values()
            )
        if self.rms and skip != "reward_model":
            mfs = self.mfs
            out["reward model params"] = (
                0.0
                if mfs.param_offload or mfs.offload_policy
                else self.rm_params * DTYPE_BYTES[mfs.model_dtype] / shard_count(world, mfs)
            )
        return out

    def gen_phase(self) -> None:
        """Generation: vLLM takes its share of the GPU, training keeps its resident shards beside it;
        sets ``awake``, what the engine keeps during the training phases (asleep or not)."""
        s, rollout, on_gpu = self.s, self.cfg.actor_rollout_ref.rollout, self.on_gpu
        tp = rollout.tensor_model_parallel_size
        rb = DTYPE_BYTES[rollout.dtype]
        max_len = rollout.max_model_len or (self.P + self.R)
        vllm_share = rollout.gpu_memory_utilization * self.capacity
        vllm_gen = {"vLLM (gpu_memory_utilization)": vllm_share}
        paged = planned_engine(rollout.name).paged  # (rlhf_hpc.config.engines: a server-style engine)
        if paged and not on_gpu:  # vLLM's CPU build: its weights and a KV cache of a fixed size
            kv_per_token = kv_bytes_per_token(s, rb, tp)
            vllm_share = (
                s.params * rb / tp
                + cpu_kv_cache_bytes(rollout.max_num_seqs, max_len, kv_per_token)
                + VLLM_CPU_RUNTIME_GB * GiB
            )
            vllm_gen = {"vLLM (weights + KV cache + its runtime)": vllm_share}
        elif paged:
            batched = max(rollout.max_num_batched_tokens, max_len)
            weights = s.params * rb / tp
            act = batched * (4 * s.hidden + (2 * s.intermediate + (s.heads + 2 * s.kv_heads) * s.head_dim) / tp) * rb
            sampler = min(rollout.max_num_seqs, batched) * s.vocab * 4 * 2
            graphs = 0 if rollout.enforce_eager else CUDA_GRAPHS_GB * GiB
            kv_per_token = kv_bytes_per_token(s, rb, tp)
            self.kv_tokens = int((vllm_share - weights - act - sampler - graphs) // kv_per_token) if on_gpu else None
        else:  # transformers generate: a full copy of the weights in the rollout dtype and its KV cache
            vllm_gen = {"hf engine weights": s.params * rb}
        if self.cfg.split:  # a rollout rank holds its engine alone; a trainer rank no engine
            self.phases.append(
                Phase(
                    "gen",
                    {"runtime": self.runtime, **vllm_gen},
                    ["actor_rollout_ref.rollout.gpu_memory_utilization"],
                    "a rollout rank; the other phases: a trainer rank",
                )
            )
            self.awake = {}
            return
        self.phases.append(
            Phase(
                "gen",
                {"runtime": self.runtime, **vllm_gen, **self.resident("gen")},
                [
                    "actor_rollout_ref.rollout.gpu_memory_utilization",
                    *offload_keys("actor_rollout_ref.actor", self.afs),
                    *(
                        offload_keys("actor_rollout_ref.ref", self.rfs, optimizer=False)
                        if self.use_ref and not self.ref_in_actor
                        else []
                    ),
                    *(offload_keys("critic.model", self.cfs) if self.use_critic else []),
                    *(offload_keys("reward_model.model", self.mfs, optimizer=False) if self.rms else []),
                ],
            )
        )
        # vLLM during the training phases: asleep (sleep mode frees weights and KV cache) or not
        self.awake = {} if (rollout.free_cache_engine and on_gpu) or not paged else {"vLLM (not freed)": vllm_share}
        if not paged:
            self.awake = {"hf engine weights": s.params * rb}

    def forward_phase(self, name: str, shp: ModelShape, fsdp: FSDPConfig, head_vocab: int, keys: list[str]) -> None:
        tokens, resp = self.step.phase(name).micro_tokens(self.per_rank_rows, self.P, self.R)
        b = DTYPE_BYTES[fsdp.mixed_precision.param_dtype]
        parts = {
            "runtime": self.runtime,
            **self.awake,
            **self.resident("forward"),
            "unsharded group": _working(shp, fsdp, with_grad=False),
            "activations": activation_bytes(shp, tokens, b, False, False),
            "logits": logits_bytes(resp, head_vocab, b, with_grad=False) if head_vocab else tokens * 4.0,
        }
        self.phases.append(Phase(name, parts, keys, f"micro-batch {tokens} tokens"))

    def update_phase(
        self,
        name: str,
        shp: ModelShape,
        params: int,
        fsdp: FSDPConfig,
        recompute: bool,
        head_vocab: int,
        who: str,
        trainable: Optional[int] = None,
    ) -> None:
        phase = self.step.phase(name)
        tokens, resp = phase.micro_tokens(self.per_rank_rows, self.P, self.R)
        own = update_bytes(shp, params, fsdp, self.world, tokens, resp, recompute, head_vocab, trainable)
        parts = {"runtime": self.runtime, **self.awake, **self.resident("forward", skip=who), **own}
        keys = update_keys(who, phase, recompute, fsdp, shard_count(self.world, fsdp) >= self.world)
        self.phases.append(
            Phase(name, parts, keys, f"micro-batch {tokens} tokens" + (", gradient checkpointing" if recompute else ""))
        )


def check_plan(cfg: Config, device_gb: Optional[float] = None) -> tuple[Optional[MemoryPlan], list[str], list[str]]:
    """(plan, errors, warnings) for ``cfg``: a GPU phase that cannot fit, or a node's host memory
    above ``launcher.mem_gb``, is an error; host memory above this machine's (a local run) a
    warning. No plan where the model's shape is unknown. ``device_gb``: as ``build_plan``."""
    try:
        plan = build_plan(cfg, device_gb=device_gb)
    except FileNotFoundError as e:
        return None, [], [f"memory plan skipped: {e}"]
    return plan, plan.failures(), plan.warnings()


# ------------------------------------------------------------------------------- keys that shrink
UPDATE_SECTIONS = {
    "actor": (
        "actor_rollout_ref.actor",
        "actor_rollout_ref.actor",
        "actor_rollout_ref.model.enable_gradient_checkpointing",
    ),
    "critic": ("critic", "critic.model", "critic.model.enable_gradient_checkpointing"),
}


def offload_keys(prefix: str, fsdp: FSDPConfig, optimizer: bool = True) -> list[str]:
    """The offload switches of one model that are still off."""
    keys = [] if fsdp.param_offload else [f"{prefix}.fsdp_config.param_offload"]
    if optimizer and not (fsdp.param_offload or fsdp.optimizer_offload):
        keys.append(f"{prefix}.fsdp_config.optimizer_offload")
    return keys


def update_keys(
    who: str,
    phase: Optional[PhaseShape] = None,
    recompute: bool = False,
    fsdp: Optional[FSDPConfig] = None,
    fully_sharded: bool = False,
) -> list[str]:
    """The keys that shrink the update of ``who`` (actor, critic), in the order worth trying: given
    the plan's state (its phase shape, activation checkpointing, layout, sharded over every rank),
    those that still change something; without it (an out-of-memory report), all of them."""
    prefix, model, recompute_key = UPDATE_SECTIONS[who]
    keys = [
        f"{prefix}.ppo_max_token_len_per_gpu"
        if phase is not None and phase.dynamic
        else f"{prefix}.ppo_micro_batch_size_per_gpu (or {prefix}.use_dynamic_bsz with a token budget)"
    ]
    keys += [] if recompute else [recompute_key]
    keys += offload_keys(model, fsdp or FSDPConfig())
    return keys + ([] if fully_sharded else [f"{model}.fsdp_config.fsdp_size"])


# Config keys that shrink the memory of each phase, in the order worth trying.
MEMORY_KEYS = {
    "update_weights": ["actor_rollout_ref.rollout.update_weights_bucket_mb"],
    "gen": [
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "actor_rollout_ref.rollout.max_num_seqs",
        "actor_rollout_ref.rollout.max_num_batched_tokens",
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        "actor_rollout_ref.rollout.free_cache_engine",
    ],
    "old_log_prob": [
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu (with log_prob_use_dynamic_bsz=true)",
    ],
    "ref": [
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.ref.fsdp_config.param_offload",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu (with log_prob_use_dynamic_bsz=true)",
    ],
    "values": [
        "critic.ppo_micro_batch_size_per_gpu",
        "critic.forward_max_token_len_per_gpu (with use_dynamic_bsz=true)",
    ],
    "update_critic": update_keys("critic"),
    "update_actor": update_keys("actor"),
}


def oom_message(phase: str, peak_gb: float, device: str) -> str:
    """What to say instead of a bare out-of-memory traceback."""
    keys = MEMORY_KEYS.get(phase, ["data.train_batch_size", "data.max_response_length"])
    return (
        f"out of memory in phase '{phase}' on {device} (peak {peak_gb:.1f} GB allocated). Keys that reduce "
        f"this phase's memory: " + "; ".join(keys)
    )
