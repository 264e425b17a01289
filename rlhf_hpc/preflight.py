"""Preflight: prove an allocation can run a recipe, in minutes, before the run spends hours on it.

``python launch.py preflight recipe=... [k=v]`` starts the ranks exactly as a run of the recipe
would (locally or through Slurm, into ``<run dir>/preflight``; the job's config has
``trainer.preflight=true``), and instead of training, every rank takes part in these checks; rank 0
reports one line per check and writes them to ``RUN_DIR/preflight.txt``:

1. the process group and the meshes the recipe builds (training replicate x shard, rollout TP);
2. all-gather and all-reduce bus bandwidth on each mesh dimension, against a floor for the
   interconnect its ranks share (NVLink, PCIe, InfiniBand, Ethernet; gloo on a CPU run);
3. the rollout engine with the recipe's TP, one weight sync (with its completeness check), a short
   generation and the engine/actor log-prob agreement in the recipe's dtypes;
4. a sleep/wake cycle (GPU): the memory vLLM frees and takes back, against the memory plan;
5. one actor micro-batch at the recipe's token budget (forward and backward, no optimizer step):
   its peak against the memory plan's update phase.

A failed check names its cause and the key to change; the job then ends with that as its one-line
error (``launch.stop.record_user_error``: exit code 2, no requeue). Nothing of a run is touched:
no checkpoint is written and the weights never change (no optimizer step).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from rlhf_hpc.config.engines import ENGINES
from rlhf_hpc.config.schema import Config
from rlhf_hpc.data.dataset import load_examples
from rlhf_hpc.distributed import sequence_parallel
from rlhf_hpc.distributed.fsdp import finish_gradient_sync, set_gradient_sync
from rlhf_hpc.distributed.process_group import (
    DistContext,
    all_reduce_max,
    all_reduce_min,
    all_reduce_sum,
    build_rollout_tp_group,
    build_train_mesh,
    device_memory_gb,
    mesh_shape,
)
from rlhf_hpc.distributed.rows import RolloutRow
from rlhf_hpc.models.hf import torch_dtype
from rlhf_hpc.models.tokenizer import load_tokenizer, tokenizer_path
from rlhf_hpc.observability.perf import peak_memory_bytes, reset_peak_memory
from rlhf_hpc.ops.batching import make_padded_batch, to_device
from rlhf_hpc.ops.step_shape import micro_tokens
from rlhf_hpc.planning.layout import resolved_fsdp_configs
from rlhf_hpc.planning.memory_plan import check_plan
from rlhf_hpc.planning.sizing import GiB
from rlhf_hpc.planning.time_plan import workload_of
from rlhf_hpc.ppo.actor import per_token_logprobs
from rlhf_hpc.ppo.faults import FaultInjector
from rlhf_hpc.ppo.step_batch import make_step_batch, sampling_for
from rlhf_hpc.ppo.step_metrics import time_model
from rlhf_hpc.ppo.training_models import build_training_models
from rlhf_hpc.rollout.base import LogprobCheck, Sampling, logprob_mismatch
from rlhf_hpc.rollout.factory import make_engine
from rlhf_hpc.rollout.weight_sync import sync_weights_to_rollout
from rlhf_hpc.tools.tool_config import run_tools, tool_schemas

__all__ = ["BUSBW_FLOOR_GBPS", "Check", "PreflightFailed", "interconnect", "run_preflight", "write_report"]

REPORT = "preflight.txt"
# bus bandwidth (GB/s, nccl-tests' definition) below which an interconnect is taken to be broken or
# misconfigured: about a quarter of what the slowest common generation gives for large messages
# (NVLink 3/4: 230-480 all-reduce; PCIe Gen4 x16: ~20; InfiniBand HDR 200 Gb/s: ~20-24 per node;
# 25 GbE: ~2.5). gloo's floors only catch a transport that does not work at all: its 16 MiB
# all-gather on one host is 0.03-0.34 GB/s on 2-core machines (the CPU and its memory, not the link)
BUSBW_FLOOR_GBPS = {
    "NVLink": 60.0,
    "PCIe": 5.0,
    "InfiniBand": 5.0,
    "Ethernet": 0.5,
    "one host (gloo)": 0.01,
    "network (gloo)": 0.01,
}
MESSAGE_BYTES = {"cuda": 256 * 2**20, "cpu": 16 * 2**20}
PLAN_TOLERANCE = 1.3  # a measured peak above 1.3x the plan's means the plan is wrong for this job
GEN_PROMPTS, GEN_TOKENS = 4, 16  # per rank: the short generation
SYNC_SLOW = 2.0  # a weight sync this many times its plan's is explained in its line (GPU)


@dataclass
class Check:
    name: str
    ok: Optional[bool]  # None: skipped (does not apply here)
    detail: str
    fix: str = ""
    figures: dict = field(default_factory=dict)  # the measured numbers behind the line

    def line(self) -> str:
        status = "SKIP" if self.ok is None else ("OK  " if self.ok else "FAIL")
        return f"{status} {self.name:<20} {self.detail}" + (
            f"; fix: {self.fix}" if self.fix and self.ok is False else ""
        )


class PreflightFailed(Exception):
    """A check failed: the message is its line (cause and key)."""


def run_preflight(cfg: Config, ctx: DistContext, log: Callable[[str], None], checks: list) -> list[Check]:
    """All checks, collectively on every rank, appended to ``checks`` as they finish; ``log`` gets
    each line as it is known (rank 0 prints). Raises ``PreflightFailed`` (on every rank alike) at
    the first failed check."""
    arr, tr = cfg.actor_rollout_ref, cfg.trainer

    def add(check: Check) -> Check:
        checks.append(check)
        log(check.line())
        if check.ok is False:
            raise PreflightFailed(f"{check.name}: {check.detail}; fix: {check.fix}")
        return check

    def agreed(stage: str, fn: Callable[[], Check]) -> Check:
        """Run one stage on every rank; a rank's exception fails the stage on all of them (no rank
        left waiting in a collective the others never reach)."""
        try:
            check, error = fn(), None
        except Exception as e:  # noqa: BLE001 - reported as the stage's failure, with its type
            check, error = None, f"{type(e).__name__}: {e}"
        passed = error is None and check.ok is not False
        if all_reduce_min(torch.tensor([1.0 if passed else 0.0])).item() == 1.0:
            return add(check)
        if check is not None and check.ok is False:  # this rank's own verdict
            return add(check)
        return add(
            Check(
                stage,
                False,
                error or "failed on another rank (that rank's log has its line)",
                "see the error above" if error else "see the other ranks' lines",
            )
        )

    hosts: list = [None] * ctx.world_size
    dist.all_gather_object(hosts, socket.gethostname())
    add(process_group_check(cfg, ctx, hosts))
    for check in bandwidth_checks(cfg, ctx, hosts):
        add(check)

    plan, _, _ = check_plan(cfg, device_memory_gb(ctx.device))
    faults = FaultInjector(tr.inject_fault, ctx.rank)
    tokenizer = load_tokenizer(tokenizer_path(cfg), arr.model.trust_remote_code, arr.model.custom_chat_template)
    models = build_training_models(cfg, ctx, total_steps=1)
    tp_group = build_rollout_tp_group(arr.rollout.tensor_model_parallel_size, tr.n_gpus_per_node)
    state: dict = {}

    def start() -> Check:
        t0 = time.perf_counter()
        state["rollout"] = make_engine(cfg, arr.model.path, ctx.device, tp_group)
        engines = ctx.world_size // arr.rollout.tensor_model_parallel_size
        return Check(
            "rollout engine",
            True,
            f"{state['rollout'].name} up in {time.perf_counter() - t0:.1f} s "
            f"(TP={arr.rollout.tensor_model_parallel_size}, {engines} engine{'s' * (engines > 1)})",
        )

    agreed("rollout engine", start)
    rollout = state["rollout"]
    agreed("weight sync", lambda: sync_check(cfg, ctx, models, rollout, faults))
    agreed("generation", lambda: generation_check(cfg, ctx, models, rollout, tokenizer))
    slept = agreed("sleep/wake", lambda: sleep_check(cfg, ctx, rollout, plan, state))
    agreed("actor micro-batch", lambda: micro_batch_check(cfg, ctx, models, tokenizer, plan))
    if slept.ok is not None:
        agreed("sleep/wake", lambda: wake_check(cfg, ctx, models, rollout, state))
    rollout.close()  # (vLLM's teardown also ends the process group)
    return checks


# ---------------------------------------------------------------------------------------- 1
def process_group_check(cfg: Config, ctx: DistContext, hosts: list[str]) -> Check:
    fsdp = resolved_fsdp_configs(cfg)["actor"]
    replicate, shard = mesh_shape(ctx.world_size, fsdp.fsdp_size)
    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    nodes = len(dict.fromkeys(hosts))
    return Check(
        "process group",
        True,
        f"{ctx.world_size} ranks on {nodes} host{'s' * (nodes > 1)} "
        f"({ctx.backend}, {ctx.device.type}); actor mesh replicate={replicate} x shard={shard}; "
        f"rollout TP={tp} x {ctx.world_size // tp} engines",
    )


# ---------------------------------------------------------------------------------------- 2
def interconnect(ranks: list[int], hosts: list[str], device: torch.device) -> str:
    """What the ranks of one group talk over (named as in ``BUSBW_FLOOR_GBPS``)."""
    across = len({hosts[r] for r in ranks}) > 1
    if device.type != "cuda":
        return "network (gloo)" if across else "one host (gloo)"
    if across:
        ib = Path("/sys/class/infiniband")
        return "InfiniBand" if ib.is_dir() and any(ib.iterdir()) else "Ethernet"
    return "NVLink" if nvlink_active() else "PCIe"


def nvlink_active() -> bool:
    """Whether this GPU has an active NVLink (NVML, as vLLM's own topology check reads it)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        index = torch.cuda.current_device()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                    return True
            except pynvml.NVMLError:
                break
    except Exception:  # noqa: BLE001 - no NVML: PCIe's floor is the safe assumption
        return False
    return False


def bus_bandwidth(group, size: int, device: torch.device, op: str, iters: int = 3) -> float:
    """nccl-tests' bus bandwidth (GB/s) of ``op`` over ``group`` with ``size``-byte messages:
    all-reduce moves 2(n-1)/n of the buffer per rank, all-gather (n-1)/n of its output."""
    n = dist.get_world_size(group)
    elems = size // 4
    if op == "all_reduce":
        buf = torch.ones(elems, device=device)
        run = lambda: dist.all_reduce(buf, group=group)  # noqa: E731
        factor = 2 * (n - 1) / n
    else:
        out = torch.empty(elems, device=device)
        inp = torch.ones(elems // n, device=device)
        run = lambda: dist.all_gather_into_tensor(out, inp, group=group)  # noqa: E731
        factor = (n - 1) / n
    run()  # warm-up: connections, buffers
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - t0) / iters
    return size / seconds * factor / 1e9


def bandwidth_checks(cfg: Config, ctx: DistContext, hosts: list[str]) -> list[Check]:
    """One check per mesh dimension with more than one rank (the groups every rank is in)."""
    fsdp = resolved_fsdp_configs(cfg)["actor"]
    replicate, shard = mesh_shape(ctx.world_size, fsdp.fsdp_size)
    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    dims = []
    if shard > 1 or replicate > 1:
        mesh = build_train_mesh(ctx.device, ctx.world_size, fsdp.fsdp_size)
        for name in mesh.mesh_dim_names:
            if mesh[name].size() > 1:
                group = mesh.get_group(name)
                dims.append(
                    (name, group, dist.get_process_group_ranks(group), "actor_rollout_ref.actor.fsdp_config.fsdp_size")
                )
    if (
        tp > 1
    ):  # the engine's all-reduces: tp consecutive ranks (rlhf_hpc.distributed.process_group.build_rollout_tp_group)
        mine = None
        for start in range(0, ctx.world_size, tp):
            group = dist.new_group(list(range(start, start + tp)))
            if ctx.rank in range(start, start + tp):
                mine = (group, list(range(start, start + tp)))
        dims.append(("rollout TP", mine[0], mine[1], "actor_rollout_ref.rollout.tensor_model_parallel_size"))
    if not dims:
        return [Check("bandwidth", None, "one rank: no collective to measure")]
    out = []
    size = MESSAGE_BYTES["cuda" if ctx.device.type == "cuda" else "cpu"]
    for name, group, ranks, key in dims:
        link = interconnect(ranks, hosts, ctx.device)
        floor = BUSBW_FLOOR_GBPS[link]
        measured = {op: bus_bandwidth(group, size, ctx.device, op) for op in ("all_gather", "all_reduce")}
        # the group's slowest rank sets what a collective gets: agree on the minimum
        low = all_reduce_min(torch.tensor([min(measured.values())], dtype=torch.float64)).item()
        ok = low >= floor
        fix = (
            f"{link} gives far less than it should: check NCCL_SOCKET_IFNAME / NCCL_IB_HCA and the fabric, "
            f"or keep this dimension inside a node ({key})"
        )
        out.append(
            Check(
                f"bandwidth {name}",
                ok,
                f"{len(ranks)} ranks over {link}: all-gather {measured['all_gather']:.2f} GB/s, "
                f"all-reduce {measured['all_reduce']:.2f} GB/s bus bandwidth "
                f"({size // 2**20} MiB; expect >= {floor:g})",
                fix,
            )
        )
    return out


# ---------------------------------------------------------------------------------------- 3
def sync_check(cfg: Config, ctx: DistContext, models, rollout, faults) -> Check:
    rollout.resume()
    arr = cfg.actor_rollout_ref
    timing = sync_weights_to_rollout(
        models.actor.model,
        rollout,
        torch_dtype(arr.rollout.dtype),
        arr.rollout.update_weights_bucket_mb,
        transform=faults.weights_transform(0),
    )
    measured = timing["timing_s/update_weights"]
    planned = planned_sync_s(cfg, ctx)
    against = "" if planned is None else f" (time plan {planned:.2f} s, {measured / max(planned, 1e-9):.1f}x)"
    slow = ""
    if planned is not None and ctx.device.type == "cuda" and measured > SYNC_SLOW * planned:
        # (the review of issue #57: vLLM's layerwise reload does Python work and two copies per weight)
        slow = "; the plan counts the gathers and one copy per weight: vLLM's per-weight reload takes the rest"
    return Check(
        "weight sync",
        True,
        f"{len(rollout.weight_spec())} tensors in {measured:.2f} s{against}, "
        f"every name once with its shape (buckets of {arr.rollout.update_weights_bucket_mb} MB){slow}",
        figures={"measured_s": measured, "planned_s": planned},
    )


def planned_sync_s(cfg: Config, ctx: DistContext) -> Optional[float]:
    """The time plan's ``update_weights`` for this run on this hardware (None where it has none)."""
    model = time_model(cfg, ctx)
    if model is None:
        return None
    phase = model.plan(workload_of(cfg)).phase("update_weights")
    return None if phase is None else phase.seconds


def generation_check(cfg: Config, ctx: DistContext, models, rollout, tokenizer) -> Check:
    """A few of the recipe's own prompts, GEN_TOKENS tokens each; the actor scores the engine's
    tokens and the mean difference must stay within the stop rule's limit for these dtypes."""
    arr = cfg.actor_rollout_ref
    examples = load_examples(
        cfg.data.train_files, tokenizer, cfg.data, split_seed=cfg.data.seed, tools=tool_schemas(run_tools(cfg)) or None
    )  # (the prompts as the run shows them)
    dp = getattr(rollout, "dp_rank", ctx.rank)
    mine = [examples[(dp * GEN_PROMPTS + i) % len(examples)] for i in range(GEN_PROMPTS)]
    sampling = sampling_for(cfg, tokenizer, seed=cfg.trainer.seed)
    sampling.n, sampling.max_tokens = 1, min(GEN_TOKENS, cfg.data.max_response_length)
    t0 = time.perf_counter()
    groups = rollout.generate([e.prompt_ids for e in mine], sampling)
    gen_s = time.perf_counter() - t0
    rows = [
        RolloutRow(
            prompt_pos=i,
            example=i,
            prompt_ids=e.prompt_ids,
            token_ids=list(r.token_ids),
            logprobs=list(r.logprobs),
            finish_reason=r.finish_reason,
        )
        for i, (e, group) in enumerate(zip(mine, groups))
        for r in group
    ]
    batch = make_step_batch(cfg, tokenizer, rows)
    lp, _ = models.actor.compute_log_prob(
        batch,
        arr.rollout.log_prob_micro_batch_size_per_gpu,
        arr.rollout.log_prob_use_dynamic_bsz,
        arr.rollout.log_prob_max_token_len_per_gpu,
    )
    m = logprob_mismatch(batch["engine_log_probs"], lp, batch["response_mask"], all_reduce_sum, all_reduce_max)
    check = LogprobCheck(arr.rollout.dtype, arr.actor.fsdp_config.mixed_precision.param_dtype)
    # |k1| and k3: on a few dozen tokens k1 of a broken engine can come out negative
    ok = max(abs(m["rollout/engine_actor_kl"]), m["rollout/engine_actor_k3_kl"]) <= check.limit
    tokens = int(batch["response_mask"].sum())
    return Check(
        "generation",
        ok,
        f"{tokens} tokens in {gen_s:.1f} s on this rank; engine vs actor log-probs "
        f"({check.precision}): KL {m['rollout/engine_actor_kl']:.2e} "
        f"(k3 {m['rollout/engine_actor_k3_kl']:.2e}), |diff| mean "
        f"{m['rollout/logprob_diff_mean']:.2e}, max {m['rollout/logprob_diff_max']:.2e} "
        f"(limit {check.limit:g})",
        "the engine samples from other weights than the actor's: compare actor_rollout_ref.rollout.dtype "
        "with actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype, and see whether the "
        "model's architecture is tested (rlhf_hpc/models/architectures.py)",
    )


# ---------------------------------------------------------------------------------------- 4
def sleep_check(cfg: Config, ctx: DistContext, rollout, plan, state: dict) -> Check:
    """GPU with sleep mode: the engine frees its memory (weights and KV cache) for the training
    phases, about its share of the plan (``state["freed"]``: bytes, for ``wake_check``)."""
    arr = cfg.actor_rollout_ref
    if not getattr(rollout, "sleep_enabled", False):
        paged = ENGINES[rollout.name].paged
        why = (
            "vLLM's CPU build has no sleep mode: its weights and KV space stay, and the plan counts them in every phase"
            if ctx.device.type != "cuda" and paged
            else f"the {rollout.name} engine keeps its weights (the plan counts them)"
            if not paged
            else "actor_rollout_ref.rollout.free_cache_engine=false: the engine keeps its memory"
        )
        return Check("sleep/wake", None, why)
    share = arr.rollout.gpu_memory_utilization * plan.capacity if plan else None
    before = torch.cuda.mem_get_info(ctx.device)[0]
    rollout.release()
    state["freed"] = freed = torch.cuda.mem_get_info(ctx.device)[0] - before
    ok = share is None or freed >= 0.8 * share
    return Check(
        "sleep/wake",
        ok,
        f"sleep freed {freed / GiB:.1f} GiB (plan: vLLM's share {(share or 0) / GiB:.1f} GiB, "
        f"gpu_memory_utilization={arr.rollout.gpu_memory_utilization})",
        f"vLLM freed less than its share of the plan's {(plan.capacity if plan else 0) / GiB:.0f} GiB GPU "
        f"({(plan.capacity_source if plan else '') or 'the 80 GiB default'}): if the GPU is smaller, set "
        f"hardware.hbm_gb; else training would run beside vLLM: check the vLLM version (env/setup.sh gpu) "
        f"and actor_rollout_ref.rollout.free_cache_engine",
    )


def wake_check(cfg: Config, ctx: DistContext, models, rollout, state: dict) -> Check:
    """After the training phase: the engine takes its memory back (new weights, then the KV cache
    on the next generation), no more than it freed."""
    arr = cfg.actor_rollout_ref
    freed_then = state.get("freed", 0)
    torch.cuda.empty_cache()  # what the micro-batch left in PyTorch's cache is not the engine's
    before = torch.cuda.mem_get_info(ctx.device)[0]
    rollout.resume()
    sync_weights_to_rollout(
        models.actor.model, rollout, torch_dtype(arr.rollout.dtype), arr.rollout.update_weights_bucket_mb
    )
    rollout.generate([[1, 2, 3]], Sampling(n=1, max_tokens=4, do_sample=False))  # wakes the KV cache
    taken = before - torch.cuda.mem_get_info(ctx.device)[0]
    ok = taken <= 1.1 * freed_then + GiB
    return Check(
        "sleep/wake",
        ok,
        f"wake took back {taken / GiB:.1f} GiB of the {freed_then / GiB:.1f} GiB freed",
        "vLLM takes more on wake than it gave back: lower actor_rollout_ref.rollout.gpu_memory_utilization",
    )


# ---------------------------------------------------------------------------------------- 5
def micro_batch_check(cfg: Config, ctx: DistContext, models, tokenizer, plan) -> Check:
    """The largest micro-batch the actor update will see (rlhf_hpc.ops.step_shape.micro_tokens):
    rows of full-length prompt + response, forward and backward with the gradient reduction, no
    optimizer step (the weights stay as they are); its peak against the plan's update phase less
    the optimizer state, which the first optimizer step allocates (exact arithmetic in the plan)."""
    arr, d = cfg.actor_rollout_ref, cfg.data
    actor = models.actor
    P, R = d.max_prompt_length, d.max_response_length
    per_rank_rows = max(1, d.train_batch_size * arr.rollout.n // max(ctx.world_size, 1))
    sp = arr.actor.ulysses_sequence_parallel_size
    tokens, _ = micro_tokens(
        arr.actor.ppo_micro_batch_size_per_gpu,
        per_rank_rows,
        arr.actor.use_dynamic_bsz,
        arr.actor.ppo_max_token_len_per_gpu,
        P,
        R,
        sp,
    )
    rows = max(1, tokens // (P + R))
    gen = torch.Generator().manual_seed(cfg.trainer.seed)
    vocab = len(tokenizer)
    ids = lambda n: torch.randint(3, max(4, vocab - 1), (n,), generator=gen).tolist()  # noqa: E731
    batch = make_padded_batch(
        [ids(P) for _ in range(rows)], [ids(R) for _ in range(rows)], tokenizer.pad_token_id or 0, P, R
    )
    if actor.sp is not None:
        batch = sequence_parallel.gather_rows(batch, actor.sp)[0]
    on_gpu = ctx.device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize(ctx.device)
    reset_peak_memory(ctx.device)
    t0 = time.perf_counter()
    actor.model.train()
    set_gradient_sync(actor.model, True)
    micro = to_device(batch, ctx.device)
    lp, _ = per_token_logprobs(actor.model, micro, actor.temperature, actor.remove_padding, sp=actor.sp)
    (-(lp * micro["response_mask"]).sum() / micro["response_mask"].sum()).backward()
    finish_gradient_sync(actor.model)
    if on_gpu:
        torch.cuda.synchronize(ctx.device)
    seconds = time.perf_counter() - t0
    peak = peak_memory_bytes(ctx.device)
    actor.optimizer.zero_grad(set_to_none=True)
    peak = -all_reduce_min(torch.tensor([-float(peak)], dtype=torch.float64)).item()  # the largest rank's
    detail = f"{rows} rows x {P + R} tokens, forward + backward in {seconds:.1f} s: peak {peak / GiB:.2f} GiB"
    figures = {"rows": rows, "tokens": rows * (P + R), "seconds": seconds, "peak_gib": peak / GiB}
    phase = next((p for p in plan.phases if p.name == "update_actor"), None) if plan else None
    if phase is None:
        return Check("actor micro-batch", True, detail + " (no memory plan for this model)", figures=figures)
    optimizer = phase.parts.get("optimizer", 0.0)
    # GPU: max_memory_allocated counts tensors only (not the CUDA context the plan's runtime holds)
    planned = phase.total - optimizer - (phase.parts.get("runtime", 0.0) if on_gpu else 0.0)
    projected = peak + optimizer + (phase.parts.get("runtime", 0.0) if on_gpu else 0.0)
    ratio = peak / max(planned, 1.0)
    fits = projected <= plan.capacity
    ok = fits and ratio <= PLAN_TOLERANCE
    detail += (
        f", plan {planned / GiB:.2f} GiB for it ({ratio:.2f}x; the optimizer's {optimizer / GiB:.2f} GiB comes "
        f"with the first step: {projected / GiB:.1f} of {plan.capacity / GiB:.0f} GiB)"
    )
    why = (
        "the update would not fit"
        if not fits
        else f"the plan underestimates this phase by more than {PLAN_TOLERANCE}x (please report it)"
    )
    figures.update(plan_gib=planned / GiB, plan_ratio=ratio)
    return Check("actor micro-batch", ok, detail, f"{why}: lower {', '.join(phase.shrink[:3])}", figures)


def write_report(run_dir: Path, checks: list[Check], failed: Optional[str]) -> Path:
    path = Path(run_dir) / REPORT
    lines = [c.line() for c in checks] + ([f"preflight failed: {failed}"] if failed else ["preflight passed"])
    tmp = path.with_name(f".{REPORT}.tmp-{os.getpid()}")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path
