"""GPU readiness check: the GPU code paths measured on one device, in one command, in minutes.

    python -m rlhf_hpc.hardware_checks.gpu_check OUT_DIR [--budget-s 480] [--cpu-smoke] [--only TEXT]

On one GPU (world size 1: alone, or under ``torchrun --nproc-per-node=1``; NCCL) it builds
random-weight models with the real shapes of Qwen2.5-0.5B and -7B (configs in code, no downloads;
vLLM and flash-attn used where installed) and measures, each case on its own freshly built model:

  env              versions, the device, a bf16 matmul's TFLOP/s (the ceiling MFU is held against)
  7B update step   first: one full update step of the 7B shape (4 of its layers) without offload, with
                   the 7B recipe's optimizer offload and with param+optimizer offload, one CPU thread:
                   forward/backward, clipping, state moves and optimizer.step timed apart; the memory
                   plan's estimate against the measured peak. With parameter offload AdamW runs on the host: its
                   estimate comes from a probe of this host's AdamW rate, not a constant
  attention        a packed row of sequences: sdpa with the dense block-diagonal mask transformers
                   builds for packed sequences vs per-sequence causal sdpa vs torch's varlen kernel
  tiny KL-PPO      two steps of the ``tiny_klppo`` recipe end to end on the device in bf16 (fit():
                   critic, reference, checkpoint, validation; flash-attn's kernel where installed)
                   with the colocated engine: vLLM where it is installed (asleep in the training
                   phases, woken, reloaded in place with its verdicts, its log-probs against the
                   actor's), else hf; then in fp32 with LoRA on the actor, whose second weight sync
                   must move the adapter alone (vLLM)
  preflight        ``launch.py preflight``'s checks on this device (rlhf_hpc/preflight.py) with that
                   engine: its start, weight sync, generation agreement, vLLM's sleep and wake against
                   the memory plan, one actor micro-batch's peak against the plan
  memory per phase ``fit()`` with Qwen2.5-0.5B's layers (vocabulary 64: the built-in tokenizer's) and
                   512-token responses in bf16: every memory-plan phase's estimate against the peak
                   ``max_memory_allocated`` measured in that phase
  actor update     tokens/s, MFU, peak memory: packed + dynamic token budget, activation
                   checkpointing off/on, attention sdpa or varlen (rlhf_hpc/models/attention.py, checked
                   against sdpa's log-probs first)
  forward          reference log-probs, tokens/s
  rollout          streaming weight sync into the hf engine (time, peak memory rise), then
                   generate (tokens/s)
  split layout     (last) ``launch.py recipe=tiny_grpo_async`` as its own torchrun job on
                   two devices: 1 trainer + 1 rollout rank, one-step-off, the weights sent over NCCL;
                   the step against the time plan's split and colocated figures, the generation
                   overlapped with the update, each side's idle share (skipped with one GPU; on a
                   node with more, beyond the default budget's ~8 minutes: --budget-s 600)

A time budget (``--budget-s``, counted from start; the estimates add up to about 8 minutes on a
GPU) skips a case whose estimate no longer fits and says so; ``--only`` runs the cases whose name
holds its text; estimates are rescaled by how the finished cases compared with theirs. Each finished case
prints a line; the table comes last; ``OUT_DIR/gpu_check.json`` (rewritten after every case, so a
killed run keeps what it measured) and ``OUT_DIR/gpu_check.md`` hold the figures. The exit code is
1 when a case failed with an error (an out-of-memory result is a measurement, not an error).

``--cpu-smoke`` runs the same code on tiny shapes with gloo on the CPU, so the script cannot rot.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from rlhf_hpc.hardware_checks.gpu_check_cases import (
    UPDATE_MODES,
    CaseSkipped,
    actor_update_case,
    attention_case,
    forward_case,
    host_adamw_s_per_param,
    preflight_case,
    rollout_case,
    split_layout_case,
    tiny_klppo_case,
    update_step_case,
    update_step_estimate_s,
)
from rlhf_hpc.hardware_checks.gpu_check_setup import (
    GPU_WORK,
    PLAN_LAYERS,
    QWEN25_0_5B,
    QWEN25_7B_4L,
    SMOKE_L,
    SMOKE_PLAN,
    SMOKE_S,
    SMOKE_WORK,
    Models,
    Workload,
    env_info,
    free_memory,
    peak_memory_gib,
)
from rlhf_hpc.planning.sizing import model_shape

__all__ = ["main"]  # launch.py gpu-check, or python -m rlhf_hpc.hardware_checks.gpu_check

START = time.monotonic()
# what the engine cases check only where vLLM is installed (elsewhere they run the hf engine)
NOT_CHECKED_WITHOUT_VLLM = (
    "vLLM's sleep and wake (the KV cache and weights released between rollouts)",
    "the in-place reload into vLLM and its completeness verdicts",
    "LoRA served by vLLM (the adapter registered once per sync)",
    "engine-vs-trainer log-probs under vLLM's kernels",
    "the preflight's vLLM checks (weight-sync time, agreement)",
)


# ------------------------------------------------------------------------------------ the run
@dataclass
class Case:
    name: str
    model: str
    est_s: float  # estimated seconds on the target (GPU) or smoke machine
    fn: Callable[[], dict]


@dataclass
class Check:
    out_dir: Path
    budget_s: float
    device: torch.device
    smoke: bool
    work: Workload
    env: dict = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)
    spent_est: float = 0.0
    spent_real: float = 0.0
    not_checked: list[str] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.monotonic() - START

    def scale(self) -> float:
        """How long finished cases took relative to their estimates (never below a half)."""
        return max(0.5, self.spent_real / self.spent_est) if self.spent_est else 1.0

    def run(self, case: Case) -> dict:
        left = self.budget_s - self.elapsed()
        need = case.est_s * self.scale()
        row = {"case": case.name, "model": case.model}
        if need > left:
            row.update(status="skipped", note=f"needs ~{need:.0f} s, {max(left, 0):.0f} s of the budget left")
        else:
            free_memory(self.device)
            init_process_group(self.device)  # (a vLLM engine's shutdown destroys the process group)
            t0 = time.monotonic()
            timed = True
            try:
                row.update(case.fn())
                row["status"] = "ok"
            except CaseSkipped as e:  # (what this machine lacks: said, not an error, kept out of the rescaling)
                row.update(status="skipped", note=str(e))
                timed = False
            except torch.OutOfMemoryError as e:
                row.update(status="oom", note=str(e).splitlines()[0][:200], peak_gib=peak_memory_gib(self.device))
            except Exception as e:  # one broken case must not cost the rest of the run
                row.update(
                    status="error", note=f"{type(e).__name__}: {e}"[:300], traceback=traceback.format_exc()[-3000:]
                )
            row["wall_s"] = time.monotonic() - t0
            if timed:
                self.spent_est += case.est_s
                self.spent_real += row["wall_s"]
            free_memory(self.device)
        self.rows.append(row)
        print(
            f"[gpu_check] {self.elapsed():6.1f}s {row['model']:>13} | {row['case']:<44} {row['status']:>7} "
            f"{_brief(row)}",
            flush=True,
        )
        self.write()
        return row

    def write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        data = {
            "mode": "cpu-smoke" if self.smoke else "gpu",
            "budget_s": self.budget_s,
            "elapsed_s": self.elapsed(),
            "env": self.env,
            "cases": self.rows,
            "not_checked": self.not_checked,
        }
        tmp = self.out_dir / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(data, indent=1, default=str))
        os.replace(tmp, self.out_dir / "gpu_check.json")

    def table(self) -> str:
        lines = [
            "| model | case | status | tokens/s | MFU | peak mem (GiB) | time (s) | notes |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in self.rows:
            tps = f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else ""
            mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else ""
            mem = f"{r['peak_gib']:.2f}" if "peak_gib" in r else ""
            secs = f"{r['time_s']:.3f}" if "time_s" in r else ""
            lines.append(
                f"| {r['model']} | {r['case']} | {r['status']} | {tps} | {mfu} | {mem} | {secs} | {r.get('note', '')} |"
            )
        return "\n".join(lines)


def _brief(row: dict) -> str:
    keys = ("tokens_per_s", "mfu", "peak_gib", "time_s")
    parts = [f"{k}={row[k]:.4g}" for k in keys if isinstance(row.get(k), (int, float))]
    return " ".join(parts) + (f"  {row['note']}" if row.get("note") else "")


# ------------------------------------------------------------------------------- the cases, in order
def cases(models: Models, device: torch.device, work: Workload, smoke: bool) -> list[Case]:
    """The cases, in order, with their estimates: on a GPU about 470 s in all (the host-AdamW case's
    from a probe of this host: ~35 s of it on a 16-core host), within the default 480 s budget. The
    colocated engine's three cases are vLLM's where it is installed, the hf engine's otherwise."""
    small = SMOKE_S if smoke else QWEN25_0_5B
    plan_shape = SMOKE_PLAN if smoke else PLAN_LAYERS
    k = 0.1 if smoke else 1.0  # the smoke estimates: seconds on a 2-core CPU
    engine = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    # a vLLM engine's start (CUDA graphs off: tiny_klppo's enforce_eager) is most of its cases' time
    start = (30 if smoke else 20) if engine == "vllm" else 0
    # first what decides the design: the 7B update step in each offload mode (host AdamW or not)
    step_shape = SMOKE_L if smoke else QWEN25_7B_4L
    host_rate = host_adamw_s_per_param()
    step_params = model_shape(step_shape.path).params
    out = [
        Case(
            f"7B update step, {mode}",
            step_shape.name,
            update_step_estimate_s(mode, step_params, k, host_rate),
            lambda m=mode: update_step_case(models, step_shape, work, device, m, 7_615_616_512),
        )
        for mode in UPDATE_MODES
    ]
    moe_engine = engine if device.type == "cuda" else "hf"
    out += [
        Case("attention: packed, dense mask vs per sequence", "-", 5 * k, lambda: attention_case(device, work)),
        # the colocated engine: the trainer's loop, LoRA's adapter-only sync, the preflight's checks
        Case(
            f"tiny KL-PPO in bf16, {engine} engine (fit)",
            "tiny_klppo",
            (40 if not smoke else 15) + start,
            lambda: tiny_klppo_case(device, bf16=True, engine=engine),
        ),
        Case(
            f"tiny KL-PPO with LoRA, {engine} engine (fit)",
            "tiny_klppo",
            (40 if not smoke else 15) + start,
            lambda: tiny_klppo_case(device, engine=engine, lora_rank=8),
        ),
        # (vLLM returns routing only on a GPU: its CPU build has no Model Runner V2)
        Case(
            f"tiny KL-PPO of a mixture of experts with routing replay, {moe_engine} engine (fit)",
            "tiny_klppo",
            (40 if not smoke else 15) + start,
            lambda: tiny_klppo_case(device, bf16=True, engine=moe_engine, moe=True),
        ),
        Case(
            f"preflight on this device (tiny_klppo, {engine} engine)",
            "tiny_klppo",
            (25 if not smoke else 10) + start,
            lambda: preflight_case(device, engine),
        ),
        Case(
            "memory plan per phase: fit, bf16, 512-token responses",
            plan_shape.name,
            90 * k if not smoke else 20,
            lambda: tiny_klppo_case(device, bf16=True, plan_shape=plan_shape, response_len=512 if not smoke else 32),
        ),
        Case(
            "actor update: packed+dynamic, AC off",
            small.name,
            25 * k,
            lambda: actor_update_case(models, small, work, device, grad_ckpt=False),
        ),
        Case(
            "actor update: packed+dynamic, AC on",
            small.name,
            25 * k,
            lambda: actor_update_case(models, small, work, device, grad_ckpt=True),
        ),
        Case(
            "actor update: packed+dynamic, AC off, varlen attn",
            small.name,
            30 * k,
            lambda: actor_update_case(models, small, work, device, grad_ckpt=False, attn="varlen"),
        ),
        Case(
            "reference log-prob forward",
            small.name,
            15 * k,
            lambda: forward_case(models, small, work, device, critic=False),
        ),
        Case(
            "rollout: weight sync + hf generate", small.name, 40 * k, lambda: rollout_case(models, small, work, device)
        ),
        # last, past the default budget's cases: the split layout (one-step-off) as its own torchrun
        # job, on two devices of a GPU node (skipped with one)
        Case(
            f"split layout: 1 trainer + 1 rollout rank, one-step-off, {engine} on the rollout rank",
            "tiny_grpo_async",
            (60 if not smoke else 20) + start,
            lambda: split_layout_case(device, engine),
        ),
    ]
    return out


# ------------------------------------------------------------------------------------ main
def init_process_group(device: torch.device) -> None:
    """World size 1: torchrun's environment when there is one, else a local TCP rendezvous."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    if dist.get_world_size() != 1:
        raise SystemExit(f"gpu_check measures one device: start it with one process, not {dist.get_world_size()}")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("out_dir", help="folder for gpu_check.json and gpu_check.md (created)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-clock budget from start, seconds (default 480 on a GPU, 60 with --cpu-smoke)",
    )
    ap.add_argument("--only", default=None, help="run only the cases whose name holds this text (e.g. vllm)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (gloo): the same code path")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    else:
        print("gpu_check: torch sees no GPU here; use --cpu-smoke on a CPU machine", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = SMOKE_WORK if args.cpu_smoke else GPU_WORK
    budget = args.budget_s if args.budget_s is not None else (60.0 if args.cpu_smoke else 480.0)
    init_process_group(device)
    check = Check(Path(args.out_dir), budget, device, args.cpu_smoke, work)
    check.env = env_info(device, work)
    if importlib.util.find_spec("vllm") is None:
        check.not_checked = [f"{what} (vLLM is not installed here)" for what in NOT_CHECKED_WITHOUT_VLLM]
    print(f"[gpu_check] {json.dumps(check.env)}", flush=True)
    for case in cases(Models(device), device, work, args.cpu_smoke):
        if args.only is None or args.only in case.name:
            check.run(case)
    table = check.table()
    (check.out_dir / "gpu_check.md").write_text(table + "\n")
    check.write()
    for what in check.not_checked:  # (before the summary: the table stays the output's tail)
        print(f"not checked: {what}", flush=True)
    env = check.env
    where = env.get("gpu") or f"CPU ({env.get('cpu_cores')} cores)"
    print(
        f"\n{where}, torch {env['torch']}, transformers {env['transformers']}, attention "
        f"{env['attn_implementation']}, bf16 matmul {env['matmul_bf16_tflops']:.1f} TFLOP/s measured, MFU against "
        f"{env['peak_tflops_assumed']:g} TFLOP/s; total {check.elapsed():.0f} s of a {budget:.0f} s budget"
    )
    print(table, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if any(r["status"] == "error" for r in check.rows) else 0


if __name__ == "__main__":
    from rlhf_hpc.distributed.process_group import exit_process

    exit_process(main())
