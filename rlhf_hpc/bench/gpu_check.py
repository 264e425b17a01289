"""GPU readiness check: the GPU code paths measured on one device, in one command, in minutes.

    python -m rlhf_hpc.bench.gpu_check OUT_DIR [--budget-s 420] [--cpu-smoke]

On one GPU (world size 1: alone, or under ``torchrun --nproc-per-node=1``; NCCL) it builds
random-weight models with the real shapes of Qwen2.5-0.5B, -1.5B and -7B (configs in code, no
downloads, no vLLM or flash-attn needed) and measures, each case on its own freshly built model:

  env              versions, the device, a bf16 matmul's TFLOP/s (the ceiling MFU is held against)
  attention        a packed row of sequences: sdpa with the dense block-diagonal mask transformers
                   builds for packed sequences vs per-sequence causal sdpa vs torch's varlen kernel
  tiny KL-PPO      two steps of the ``tiny_klppo`` recipe end to end on the device (fit(), hf engine,
                   critic, reference, checkpoint, validation), in fp32 and in bf16 (flash-attn's
                   kernel where it is installed)
  memory per phase the same ``fit()`` with Qwen2.5-0.5B's layers (vocabulary 64: the built-in
                   tokenizer's) and 512-token responses in bf16: every memory-plan phase's
                   estimate against the peak ``max_memory_allocated`` measured in that phase
  preflight        ``launch.py preflight``'s checks on this device (rlhf_hpc/preflight.py): engine,
                   weight sync, generation agreement, one actor micro-batch's peak against the plan
  actor update     tokens/s, MFU, peak memory: packed + dynamic token budget, activation
                   checkpointing off/on, attention sdpa or varlen (rlhf_hpc/models/attention.py, checked
                   against sdpa's log-probs first), padded fixed micro-batches on 0.5B as the baseline
  forward          reference log-probs and critic values, tokens/s
  rollout          streaming weight sync into the hf engine (time, peak memory rise), then
                   generate (tokens/s)
  7B update step   first: one full update step of the 7B shape (4 of its layers) without offload, with
                   the 7B recipe's optimizer offload and with param+optimizer offload, one CPU thread:
                   forward/backward, clipping, state moves and optimizer.step timed apart; the memory
                   plan's estimate against the measured peak. With parameter offload AdamW runs on the host: its
                   estimate comes from a probe of this host's AdamW rate, not a constant
  7B offload       one actor forward/backward micro-batch with param+optimizer offload off and on

A time budget (``--budget-s``, counted from start) skips a case whose estimate no longer fits and
says so; estimates are rescaled by how the finished cases compared with theirs. Each finished case
prints a line; the table comes last; ``OUT_DIR/gpu_check.json`` (rewritten after every case, so a
killed run keeps what it measured) and ``OUT_DIR/gpu_check.md`` hold the figures. The exit code is
1 when a case failed with an error (an out-of-memory result is a measurement, not an error).

``--cpu-smoke`` runs the same code on tiny shapes with gloo on the CPU, so the script cannot rot.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import platform
import shutil
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from rlhf_hpc.config.schema import ActorConfig, CriticConfig, FSDPConfig, MixedPrecisionConfig
from rlhf_hpc.distributed.fsdp import parallelize
from rlhf_hpc.distributed.process_group import DistContext, build_train_mesh
from rlhf_hpc.models.hf import attn_implementation, build_causal_lm, build_critic, model_config
from rlhf_hpc.observability.perf import memory_metrics, model_flops, peak_flops, peak_memory_bytes, reset_peak_memory
from rlhf_hpc.observability.tracking import read_metrics
from rlhf_hpc.ops import policy_losses
from rlhf_hpc.ops.batching import make_padded_batch, to_device
from rlhf_hpc.planning.memory_plan import check_plan, update_bytes
from rlhf_hpc.planning.sizing import model_shape
from rlhf_hpc.ppo import checkpoint as ckpt
from rlhf_hpc.ppo.actor import Actor, ActorSpec, per_token_logprobs
from rlhf_hpc.ppo.critic import Critic, CriticSpec
from rlhf_hpc.ppo.optim import build_optimizer, clip_grad_norm, move_optimizer_state
from rlhf_hpc.ppo.trainer import fit
from rlhf_hpc.ppo.update import Placement
from rlhf_hpc.preflight import run_preflight
from rlhf_hpc.recipe.load import load_config, write_resolved
from rlhf_hpc.rollout.base import Sampling
from rlhf_hpc.rollout.factory import make_engine
from rlhf_hpc.rollout.weight_sync import stream_full_params, sync_weights_to_rollout

__all__ = ["host_adamw_s_per_param"]

START = time.monotonic()


# ------------------------------------------------------------------------------------ shapes
@dataclass(frozen=True)
class Shape:
    """A Qwen2-architecture model, built with random weights from these fields."""
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768

    @property
    def path(self) -> str:
        """The ``tiny://qwen2?...`` address ``rlhf_hpc.models`` builds from (no download)."""
        fields = {k: v for k, v in self.__dict__.items() if k != "name"}
        return "tiny://qwen2?" + "&".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                                          for k, v in fields.items())


# the layer shapes of the published Qwen2.5 config.json files (max_position_embeddings does not
# change the compute, so one value serves all)
QWEN25_0_5B = Shape("qwen2.5-0.5b", 151936, 896, 4864, 24, 14, 2, True)
QWEN25_1_5B = Shape("qwen2.5-1.5b", 151936, 1536, 8960, 28, 12, 2, True)
QWEN25_7B = Shape("qwen2.5-7b", 152064, 3584, 18944, 28, 28, 4, False)
# the 7B shape with 4 of its 28 layers: 2.0B parameters, whose fp32 weights, gradients and Adam
# state (32 GiB) fit one GPU in every offload mode; per-parameter costs carry over to the real run
QWEN25_7B_4L = Shape("qwen2.5-7b-4L", 152064, 3584, 18944, 4, 28, 4, False)
# smoke stand-ins: same roles (tied small models, an untied "large" one), head_dim 32
SMOKE_S = Shape("smoke-s", 512, 128, 256, 2, 4, 2, True, 10000.0, 1024)
SMOKE_M = Shape("smoke-m", 512, 128, 384, 3, 4, 2, True, 10000.0, 1024)
SMOKE_L = Shape("smoke-l", 512, 192, 512, 2, 6, 2, False, 10000.0, 1024)
# the memory-per-phase run: Qwen2.5-0.5B's layers with the vocabulary of tiny_klppo's tokenizer
# (tiny://chars: a random model samples every id of its vocabulary, and this tokenizer must decode them)
PLAN_LAYERS = Shape("qwen2.5-0.5b-layers", 64, 896, 4864, 24, 14, 2, True)
SMOKE_PLAN = Shape("smoke-plan", 64, 128, 384, 3, 4, 2, True, 10000.0, 1024)


@dataclass(frozen=True)
class Workload:
    """Sizes of the measured batches. Lengths are drawn like RL rollouts: most responses short,
    a fifth long."""
    rows: int  # responses in one actor update (one mini-batch: one optimizer step)
    prompt: tuple[int, int]
    short: tuple[int, int]
    long: tuple[int, int]
    max_token_len: int  # ppo_max_token_len_per_gpu (dynamic token budget per micro-batch)
    padded_micro: int  # rows per micro-batch of the padded baseline
    gen_prompts: int
    gen_prompt_len: int
    gen_tokens: int
    offload_rows: int  # the 7B micro-batch: rows x (prompt + response)
    offload_len: int
    attn_seqs: int  # the attention case: a packed row of attn_seqs x attn_len tokens
    attn_len: int
    matmul: int
    reps: int  # timed repetitions after one warm-up (the best is reported)


GPU_WORK = Workload(rows=64, prompt=(128, 512), short=(64, 256), long=(512, 1024), max_token_len=16384,
                    padded_micro=8, gen_prompts=64, gen_prompt_len=256, gen_tokens=256, offload_rows=4,
                    offload_len=512, attn_seqs=16, attn_len=1024, matmul=8192, reps=2)
SMOKE_WORK = Workload(rows=8, prompt=(8, 24), short=(4, 8), long=(16, 24), max_token_len=96, padded_micro=4,
                      gen_prompts=4, gen_prompt_len=8, gen_tokens=8, offload_rows=2, offload_len=16,
                      attn_seqs=4, attn_len=32, matmul=256, reps=1)


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
            t0 = time.monotonic()
            try:
                row.update(case.fn())
                row["status"] = "ok"
            except torch.OutOfMemoryError as e:
                row.update(status="oom", note=str(e).splitlines()[0][:200],
                           peak_gib=peak_memory_gib(self.device))
            except Exception as e:  # one broken case must not cost the rest of the run
                row.update(status="error", note=f"{type(e).__name__}: {e}"[:300],
                           traceback=traceback.format_exc()[-3000:])
            row["wall_s"] = time.monotonic() - t0
            self.spent_est += case.est_s
            self.spent_real += row["wall_s"]
            free_memory(self.device)
        self.rows.append(row)
        print(f"[gpu_check] {self.elapsed():6.1f}s {row['model']:>13} | {row['case']:<44} {row['status']:>7} "
              f"{_brief(row)}", flush=True)
        self.write()
        return row

    def write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        data = {"mode": "cpu-smoke" if self.smoke else "gpu", "budget_s": self.budget_s,
                "elapsed_s": self.elapsed(), "env": self.env, "cases": self.rows}
        tmp = self.out_dir / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(data, indent=1, default=str))
        os.replace(tmp, self.out_dir / "gpu_check.json")

    def table(self) -> str:
        lines = ["| model | case | status | tokens/s | MFU | peak mem (GiB) | time (s) | notes |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in self.rows:
            tps = f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else ""
            mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else ""
            mem = f"{r['peak_gib']:.2f}" if "peak_gib" in r else ""
            secs = f"{r['time_s']:.3f}" if "time_s" in r else ""
            lines.append(f"| {r['model']} | {r['case']} | {r['status']} | {tps} | {mfu} | {mem} | {secs} | "
                         f"{r.get('note', '')} |")
        return "\n".join(lines)


def _brief(row: dict) -> str:
    keys = ("tokens_per_s", "mfu", "peak_gib", "time_s")
    parts = [f"{k}={row[k]:.4g}" for k in keys if isinstance(row.get(k), (int, float))]
    return " ".join(parts) + (f"  {row['note']}" if row.get("note") else "")


# ------------------------------------------------------------------------------------ helpers
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def reset_peak(device: torch.device) -> None:
    reset_peak_memory(device)


def peak_memory_gib(device: torch.device) -> float:
    """Peak device memory allocated since ``reset_peak`` (on the CPU: peak resident memory)."""
    return peak_memory_bytes(device) / 2**30


def used_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**30
    return memory_metrics(device)["perf/cpu_memory_used_gb"]


def host_memory_gib() -> float:
    return memory_metrics(torch.device("cpu"))["perf/cpu_memory_used_gb"]


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> tuple[float, object]:
    """One warm-up call, then the best of ``reps`` timed calls: (seconds, last result)."""
    out = fn()
    best = math.inf
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def rollout_batch(work: Workload, vocab: int, seed: int = 0) -> dict:
    """A step batch (host tensors) shaped like rollouts: prompt lengths uniform, responses 80%
    short and 20% long; advantages random; old log-probs filled in by the caller."""
    g = torch.Generator().manual_seed(seed)

    def lengths(lo_hi: tuple[int, int], n: int) -> torch.Tensor:
        return torch.randint(lo_hi[0], lo_hi[1] + 1, (n,), generator=g)

    plen = lengths(work.prompt, work.rows)
    long = torch.rand(work.rows, generator=g) < 0.2
    rlen = torch.where(long, lengths(work.long, work.rows), lengths(work.short, work.rows))
    prompts = [torch.randint(1, vocab, (int(n),), generator=g).tolist() for n in plen]
    resps = [torch.randint(1, vocab, (int(n),), generator=g).tolist() for n in rlen]
    b = make_padded_batch(prompts, resps, 0, work.prompt[1], work.long[1])
    b["advantages"] = torch.randn(b["responses"].shape, generator=g) * b["response_mask"]
    b["old_log_probs"] = torch.zeros(b["responses"].shape)
    return b


def fixed_batch(rows: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, vocab, (rows, prompt_len), generator=g).tolist()
    resps = torch.randint(1, vocab, (rows, response_len), generator=g).tolist()
    b = make_padded_batch(prompts, resps, 0, prompt_len, response_len)
    b["advantages"] = torch.randn(b["responses"].shape, generator=g)
    b["old_log_probs"] = torch.zeros(b["responses"].shape)
    return b


def batch_flops(shape: Shape, batch: dict, passes: float, lm_head: bool = True) -> float:
    """Model FLOPs of ``passes`` forwards over ``batch`` (3 for forward + backward); the LM head
    runs on response tokens only (none for a critic, whose value head is negligible)."""
    head = float(batch["response_mask"].sum()) if lm_head else 0.0
    return passes * model_flops(model_config(shape.path), batch["attention_mask"].sum(-1).tolist(), head)


# ------------------------------------------------------------------------------------ models
class Models:
    """Builds the models of the measured cases the way ``build_training_models`` does (FSDP2 on the
    world-size-1 mesh, fp32 master weights, bf16 compute), straight on the device."""

    def __init__(self, device: torch.device):
        self.device = device

    def fsdp(self, offload: bool = False):
        return FSDPConfig(fsdp_size=-1, param_offload=offload, optimizer_offload=offload,
                          mixed_precision=MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32"))

    def actor(self, shape: Shape, work: Workload, grad_ckpt: bool = False, offload: bool = False,
              train: bool = True, packed: bool = True, attn: str = "sdpa", optimizer_offload: Optional[bool] = None):
        model = build_causal_lm(shape.path, torch.float32, self.device, seed=0, attn=attn)
        if not train:
            model.requires_grad_(False)
        parallelize(model, build_train_mesh(self.device, 1, -1), self.fsdp(offload), self.device,
                    gradient_checkpointing=grad_ckpt)
        cfg = ActorConfig(ppo_mini_batch_size=work.rows, ppo_micro_batch_size_per_gpu=work.padded_micro,
                          use_dynamic_bsz=packed, ppo_max_token_len_per_gpu=work.max_token_len, ppo_epochs=1,
                          shuffle=False, clip_ratio_low=0.2, clip_ratio_high=0.2)  # (resolve() fills these in runs)
        opt = build_optimizer(model, cfg.optim) if train else None
        opt_off = offload if optimizer_offload is None else optimizer_offload
        return Actor(model, cfg, ActorSpec(remove_padding=packed, optimizer=opt,
                                           optimizer_offload=opt_off and self.device.type == "cuda",
                                           placement=Placement(device=self.device)))

    def critic(self, shape: Shape):
        model = build_critic(shape.path, torch.float32, self.device, seed=1)
        model.requires_grad_(False)
        parallelize(model, build_train_mesh(self.device, 1, -1), self.fsdp(), self.device)
        return Critic(model, CriticConfig(use_dynamic_bsz=True, forward_max_token_len_per_gpu=32768, shuffle=False,
                                     loss_agg_mode="token-mean"),
                      CriticSpec(remove_padding=True, placement=Placement(device=self.device)))


# ------------------------------------------------------------------------------------ cases
def env_info(device: torch.device, work: Workload) -> dict:

    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "device": str(device),
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "vllm_installed": importlib.util.find_spec("vllm") is not None,
            "flash_attn_installed": importlib.util.find_spec("flash_attn") is not None,
            "attn_implementation": attn_implementation(device),
            "peak_tflops_assumed": peak_flops(device) / 1e12}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        nccl = torch.cuda.nccl.version()  # a tuple in recent releases, an int in old ones
        info.update(gpu=props.name, gpu_memory_gib=props.total_memory / 2**30, cuda=torch.version.cuda,
                    nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
                    bf16=torch.cuda.is_bf16_supported(), sm_count=props.multi_processor_count)
    else:
        info.update(cpu_cores=os.cpu_count(), threads=torch.get_num_threads())
    n = work.matmul
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    secs, _ = timed(lambda: a @ b, device, 5)
    info["matmul_bf16_tflops"] = 2 * n**3 / secs / 1e12
    return info


def attention_case(device: torch.device, work: Workload, head_dim: int = 128, heads: int = 12, kv_heads: int = 2
                   ) -> dict:
    """Packed sequences through attention: what the packed path costs with sdpa (transformers
    builds a dense block-diagonal mask over the whole packed row, so the kernel computes the full
    N x N square) against per-sequence causal attention and torch's varlen kernel."""
    import torch.nn.functional as F
    S, L = work.attn_seqs, work.attn_len
    N = S * L
    dtype = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, heads, N, head_dim, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, kv_heads, N, head_dim, device=device, dtype=dtype, generator=g)
    v = torch.randn(1, kv_heads, N, head_dim, device=device, dtype=dtype, generator=g)
    doc = torch.arange(N, device=device) // L
    pos = torch.arange(N, device=device)
    mask = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    rep = heads // kv_heads
    kf, vf = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def dense():
        return F.scaled_dot_product_attention(q, kf, vf, attn_mask=mask)

    def per_seq():
        qs = q.view(heads, S, L, head_dim).transpose(0, 1)
        ks, vs = kf.view(heads, S, L, head_dim).transpose(0, 1), vf.view(heads, S, L, head_dim).transpose(0, 1)
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        return out.transpose(0, 1).reshape(1, heads, N, head_dim)

    t_dense, o_dense = timed(dense, device, work.reps + 2)
    t_seq, o_seq = timed(per_seq, device, work.reps + 2)
    out = {"time_s": t_dense, "dense_mask_s": t_dense, "per_sequence_s": t_seq,
           "max_abs_diff": (o_dense.float() - o_seq.float()).abs().max().item(),
           "tokens_per_s": N / t_dense}
    note = f"{S}x{L} tokens packed: dense mask {t_dense * 1e3:.2f} ms vs per-sequence {t_seq * 1e3:.2f} ms"
    varlen = None
    with contextlib.suppress(ImportError):
        from torch.nn.attention.varlen import varlen_attn as varlen
    if varlen is not None and device.type == "cuda":
        import inspect
        params = inspect.signature(varlen).parameters  # its causal switch changed between releases
        causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
        cu = torch.arange(0, N + 1, L, device=device, dtype=torch.int32)
        qv, kv_, vv = (t[0].transpose(0, 1).contiguous() for t in (q, kf, vf))  # (N, heads, d)
        try:
            t_var, o_var = timed(lambda: varlen(qv, kv_, vv, cu, cu, L, L, **causal), device, work.reps + 2)
            out["varlen_s"] = t_var
            out["varlen_max_abs_diff"] = (o_var.transpose(0, 1).unsqueeze(0).float() - o_seq.float()).abs().max().item()
            note += f", varlen {t_var * 1e3:.2f} ms"
        except Exception as e:  # an optional kernel: its absence is a finding, not a failure
            note += f", varlen failed: {type(e).__name__}: {str(e)[:80]}"
    else:
        note += ", varlen n/a" + (" on cpu" if device.type != "cuda" else " (not in this torch)")
    out["note"] = note
    return out


def tiny_overrides(device: torch.device, run_dir: Path, bf16: bool = False) -> list[str]:
    """``tiny_klppo`` on this one device with the hf engine (no vLLM here); ``bf16``: every model
    and the engine in bfloat16, with flash-attn's kernel where it is installed (GPU)."""
    out = [f"trainer.device={device.type}", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
           "trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.test_freq=2",
           "trainer.logger=[console]", "trainer.resume_mode=disable", f"trainer.default_local_dir={run_dir}",
           "actor_rollout_ref.rollout.name=hf"]
    if bf16:
        out += [f"{m}.fsdp_config.mixed_precision.param_dtype=bfloat16" for m in
                ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model")]
        out.append("actor_rollout_ref.rollout.dtype=bfloat16")
        if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
            out += [f"{m}.override_config.attn_implementation=flash_attention_2"
                    for m in ("actor_rollout_ref.model", "critic.model")]
    return out


def plan_overrides(device: torch.device, shape: Shape, response_len: int) -> list[str]:
    """``tiny_klppo`` with ``shape``'s model (actor, reference, critic) and longer responses, the
    plan sized for this device's memory: the memory-per-phase case."""
    out = [f"actor_rollout_ref.model.path={shape.path}", f"data.max_response_length={response_len}",
           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
           "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4"]
    if device.type == "cuda":
        out.append(f"trainer.gpu_memory_gb={torch.cuda.get_device_properties(device).total_memory / 2**30:.1f}")
    return out


def tiny_klppo_case(device: torch.device, bf16: bool = False, plan_shape: Optional[Shape] = None,
                    response_len: int = 512) -> dict:
    """Two steps of the tiny recipe through ``fit`` on this device (hf engine: no vLLM here). With
    ``plan_shape``: that model instead, and each memory-plan phase against its measured peak
    (``memory_gb/<phase>`` of step 2; on a GPU max_memory_allocated against the plan less its
    runtime part, which that counter cannot see)."""
    run_dir = Path(tempfile.mkdtemp(prefix="gpu_check_tiny_"))
    try:
        overrides = tiny_overrides(device, run_dir, bf16)
        if plan_shape is not None:
            overrides += plan_overrides(device, plan_shape, response_len)
        cfg, _ = load_config("tiny_klppo", overrides)
        write_resolved(cfg, run_dir)
        ctx = DistContext(rank=0, world_size=1, local_rank=0, device=device, backend=dist.get_backend())
        fit(cfg, ctx)
        records = read_metrics(run_dir)
        if [r["training/global_step"] for r in records] != [1, 2]:
            raise RuntimeError(f"expected metrics for steps 1 and 2, got {[r['training/global_step'] for r in records]}")
        bad = sorted(k for r in records for k, v in r.items()
                     if isinstance(v, str) and v in ("nan", "inf", "-inf"))
        if bad:
            raise RuntimeError(f"non-finite metrics: {bad[:5]}")
        problem = ckpt.verify_checkpoint(run_dir / "global_step_2")
        if problem:
            raise RuntimeError(f"checkpoint of step 2: {problem}")
        last = records[-1]
        if plan_shape is not None:
            return memory_per_phase(check_plan(cfg)[0], last)
        return {"time_s": last["timing_s/step"], "tokens_per_s": last["perf/throughput"],
                "peak_gib": last["perf/max_memory_allocated_gb"],
                "logprob_diff_max": last["rollout/logprob_diff_max"], "score_mean": last["critic/score/mean"],
                "engine_actor_kl": last["rollout/engine_actor_kl"],
                "note": f"2 steps + checkpoint + validation{', bf16' if bf16 else ''}"
                        f"{', flash_attention_2' if any('flash_attention_2' in o for o in overrides) else ''}; "
                        f"step 2 {last['timing_s/step']:.2f} s, engine-vs-actor logprob diff "
                        f"{last['rollout/logprob_diff_max']:.1e}, KL {last['rollout/engine_actor_kl']:.1e}"}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def memory_per_phase(plan, last: dict) -> dict:
    """The plan's phases against step 2's measured peaks (the optimizer state exists from step 1's
    update on, as the plan counts it): figures per phase and the worst ratio."""
    rows = plan.against_measured(last)
    if len(rows) != len(plan.phases):
        raise RuntimeError(f"phases without a measured peak: {sorted({p.name for p in plan.phases} - {r[0] for r in rows})}")
    ratios = {name: measured / planned for name, planned, measured in rows if planned > 0}
    worst = max(ratios, key=lambda n: abs(math.log(ratios[n])))
    return {"time_s": last["timing_s/step"], "tokens_per_s": last["perf/throughput"],
            "peak_gib": last["perf/max_memory_allocated_gb"],
            "phases": {name: {"plan_gib": planned, "measured_gib": measured} for name, planned, measured in rows},
            "worst_phase": worst, "worst_measured_over_plan": ratios[worst],
            "note": "measured/plan GiB: " + ", ".join(f"{n} {m:.2f}/{p:.2f}" for n, p, m in rows)
                    + f"; worst {worst} {ratios[worst]:.2f}x"}


def preflight_case(device: torch.device) -> dict:
    """``launch.py preflight``'s checks (rlhf_hpc.preflight) in this process on this one device:
    the rank's engine start, weight sync, generation agreement, and one actor micro-batch's peak
    against the memory plan (on a GPU: max_memory_allocated against the plan less its runtime)."""
    run_dir = Path(tempfile.mkdtemp(prefix="gpu_check_preflight_"))
    try:
        cfg, _ = load_config("tiny_klppo", tiny_overrides(device, run_dir) + ["trainer.preflight=true"])
        ctx = DistContext(rank=0, world_size=1, local_rank=0, device=device, backend=dist.get_backend())
        checks: list = []
        run_preflight(cfg, ctx, lambda line: print(f"[gpu_check] preflight: {line}", flush=True), checks)
        micro = next(c for c in checks if c.name == "actor micro-batch")
        f = micro.figures
        return {"checks": [c.line() for c in checks], "time_s": f["seconds"], "tokens_per_s": f["tokens"] / f["seconds"],
                "peak_gib": f["peak_gib"], "plan_gib": f.get("plan_gib"), "plan_ratio": f.get("plan_ratio"),
                "note": f"{len(checks)} checks passed; micro-batch {micro.detail}"}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def attention_agreement(models: Models, shape: Shape, work: Workload, actor, batch: dict) -> dict:
    """Log-probs of ``actor`` (another attention implementation) against sdpa with the same
    weights (same seed) on the same batch; raises when they disagree beyond bf16 noise."""
    lp, _ = actor.compute_log_prob(batch, work.padded_micro, True, work.max_token_len)
    reference = models.actor(shape, work, train=False)
    lp_ref, _ = reference.compute_log_prob(batch, work.padded_micro, True, work.max_token_len)
    diff = (lp - lp_ref).abs()[batch["response_mask"].bool()]
    out = {"logprob_diff_vs_sdpa_max": diff.max().item(), "logprob_diff_vs_sdpa_mean": diff.mean().item()}
    if not out["logprob_diff_vs_sdpa_mean"] < 2e-2:
        raise RuntimeError(f"attention disagrees with sdpa: mean |log-prob diff| {out['logprob_diff_vs_sdpa_mean']:.3g}")
    return out


def actor_update_case(models: Models, shape: Shape, work: Workload, device: torch.device, grad_ckpt: bool,
                      packed: bool = True, attn: str = "sdpa") -> dict:
    actor = models.actor(shape, work, grad_ckpt=grad_ckpt, packed=packed, attn=attn)
    batch = rollout_batch(work, shape.vocab_size)
    agreement = attention_agreement(models, shape, work, actor, batch) if attn != "sdpa" else {}
    free_memory(device)
    resident = used_memory_gib(device)
    reset_peak(device)
    secs, metrics = timed(lambda: actor.update_policy(batch, work.rows), device, work.reps)
    if not math.isfinite(metrics["actor/pg_loss"]) or not math.isfinite(metrics["actor/grad_norm"]):
        raise RuntimeError(f"non-finite update: pg_loss {metrics['actor/pg_loss']}, grad_norm {metrics['actor/grad_norm']}")
    flops = batch_flops(shape, batch, 3)
    valid = int(batch["attention_mask"].sum())
    computed = valid if packed else batch["input_ids"].numel()
    micro = (f"token budget {work.max_token_len}" if packed else f"{work.padded_micro} rows/micro-batch")
    note = f"{work.rows} rows, {valid} tokens, {micro}"
    if agreement:
        note += f"; log-probs vs sdpa: mean diff {agreement['logprob_diff_vs_sdpa_mean']:.1e}"
    return {"time_s": secs, "tokens_per_s": valid / secs, "mfu": flops / secs / peak_flops(device),
            "peak_gib": peak_memory_gib(device), "resident_gib": resident, "valid_tokens": valid,
            "computed_tokens": computed, "model_tflop": flops / 1e12, **agreement, "note": note}


def forward_case(models: Models, shape: Shape, work: Workload, device: torch.device, critic: bool) -> dict:
    batch = rollout_batch(work, shape.vocab_size)
    if critic:
        model = models.critic(shape)
        run = lambda: model.compute_values(batch, work.padded_micro)  # noqa: E731
    else:
        model = models.actor(shape, work, train=False)
        run = lambda: model.compute_log_prob(batch, work.padded_micro, True, 2 * work.max_token_len)  # noqa: E731
    reset_peak(device)
    secs, out = timed(run, device, work.reps)
    out = out if critic else out[0]
    if not torch.isfinite(out).all():
        raise RuntimeError("non-finite forward outputs")
    flops = batch_flops(shape, batch, 1, lm_head=not critic)
    valid = int(batch["attention_mask"].sum())
    return {"time_s": secs, "tokens_per_s": valid / secs, "mfu": flops / secs / peak_flops(device),
            "peak_gib": peak_memory_gib(device), "note": f"{valid} tokens, bf16 compute"}


def sync_into(engine, models: Models, shape: Shape, work: Workload, device: torch.device, bucket_mb: float
              ) -> tuple[float, float]:
    """Stream a freshly built FSDP actor into ``engine``: (seconds, peak memory rise in GiB). The
    actor is gone when this returns, as in training the engine then has the memory to itself."""
    actor = models.actor(shape, work, train=False)
    sync(device)
    base = used_memory_gib(device)
    reset_peak(device)
    secs, _ = timed(lambda: sync_weights_to_rollout(actor.model, engine, torch.bfloat16, bucket_mb), device, work.reps)
    rise = peak_memory_gib(device) - base
    # the engine holds what the actor holds: compare one tensor end to end
    name, p = next(iter(actor.model.named_parameters()))
    full = p.full_tensor().to(torch.bfloat16)
    if not torch.equal(engine.model.get_parameter(name).to(full.device), full):
        raise RuntimeError(f"weight sync: engine parameter {name} differs from the actor's")
    return secs, rise


def rollout_case(models: Models, shape: Shape, work: Workload, device: torch.device) -> dict:
    """Weight sync FSDP actor -> hf engine (bf16), then generation with the synced weights."""
    cfg, _ = load_config("tiny_klppo", ["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.dtype=bfloat16",
                                        "trainer.n_gpus_per_node=1"])
    engine = make_engine(cfg, shape.path, device)
    bucket = cfg.actor_rollout_ref.rollout.update_weights_bucket_mb
    sync_s, sync_rise = sync_into(engine, models, shape, work, device, bucket)
    free_memory(device)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, shape.vocab_size, (work.gen_prompts, work.gen_prompt_len), generator=g).tolist()
    sampling = Sampling(n=1, temperature=1.0, max_tokens=work.gen_tokens, ignore_eos=True, seed=0)
    engine.generate(prompts[:2], Sampling(max_tokens=4, ignore_eos=True, seed=0))  # warm-up
    reset_peak(device)
    sync(device)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sampling)
    sync(device)
    gen_s = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for grp in outs for r in grp)
    if tokens != work.gen_prompts * work.gen_tokens:
        raise RuntimeError(f"generated {tokens} tokens, expected {work.gen_prompts * work.gen_tokens}")
    return {"time_s": gen_s, "tokens_per_s": tokens / gen_s, "peak_gib": peak_memory_gib(device),
            "sync_s": sync_s, "sync_peak_rise_gib": sync_rise, "bucket_mb": bucket,
            "note": f"{work.gen_prompts} prompts x {work.gen_prompt_len} -> {work.gen_tokens} tokens, bf16; "
                    f"weight sync {sync_s:.3f} s, peak rise {sync_rise:.2f} GiB ({bucket} MiB buckets)"}


def offload_case(models: Models, shape: Shape, work: Workload, device: torch.device, offload: bool) -> dict:
    """One actor forward/backward micro-batch (activation checkpointing on, as the 7B recipe)."""
    actor = models.actor(shape, work, grad_ckpt=True, offload=offload)
    batch = fixed_batch(work.offload_rows, work.offload_len, work.offload_len, shape.vocab_size)
    micro = to_device(batch, device)
    model = actor.model
    model.train()

    def fwd_bwd():
        lp, _ = per_token_logprobs(model, micro, remove_padding=True)
        loss, _ = policy_losses.ppo_clip_loss(micro["old_log_probs"], lp, micro["advantages"], micro["response_mask"])
        loss.backward()
        return loss.item()

    sync(device)
    resident = used_memory_gib(device)
    host = host_memory_gib()
    reset_peak(device)
    secs, loss = timed(fwd_bwd, device, 1)
    if not math.isfinite(loss):
        raise RuntimeError(f"non-finite loss {loss}")
    flops = batch_flops(shape, batch, 3)
    valid = int(batch["attention_mask"].sum())
    peak = peak_memory_gib(device)
    model.zero_grad(set_to_none=True)
    # the weight stream a rollout engine would read (with offload: host shards -> device first)
    sync(device)
    t0 = time.perf_counter()
    streamed = sum(t.numel() * t.element_size() for _, t in stream_full_params(model, torch.bfloat16, 512))
    sync(device)
    stream_s = time.perf_counter() - t0
    return {"time_s": secs, "tokens_per_s": valid / secs, "mfu": flops / secs / peak_flops(device),
            "peak_gib": peak, "resident_gib": resident, "host_gib": host, "stream_s": stream_s,
            "streamed_gib": streamed / 2**30,
            "note": f"{work.offload_rows}x{2 * work.offload_len} tokens, AC on, params "
                    f"{'on the host' if offload else 'on the device'}; resident {resident:.1f} GiB, host {host:.1f} GiB; "
                    f"weight stream {streamed / 2**30:.1f} GiB bf16 in {stream_s:.2f} s"}


UPDATE_MODES = {"no offload": (False, False), "optimizer offload (7B recipe)": (False, True),
                "param+optimizer offload": (True, True)}


def update_step_case(models: Models, shape: Shape, work: Workload, device: torch.device, mode: str,
                     full_params: int) -> dict:
    """One full update step (forward/backward of a micro-batch, gradient clipping, the optimizer's
    state moves and step) with one CPU thread, as under torchrun (OMP_NUM_THREADS=1), timing each
    part; then the memory plan's estimate for this step against the measured peak (on a GPU:
    max_memory_allocated; the CPU smoke run's peak RSS includes the whole process). Per-parameter
    costs are scaled to ``full_params`` / 8 (a rank's shard of the real model on 8 GPUs)."""
    param_off, opt_off = UPDATE_MODES[mode]
    actor = models.actor(shape, work, grad_ckpt=True, offload=param_off, optimizer_offload=opt_off)
    model, opt = actor.model, actor.optimizer
    batch = fixed_batch(work.offload_rows, work.offload_len, work.offload_len, shape.vocab_size)
    micro = to_device(batch, device)
    model.train()
    home = next(model.parameters()).device  # the host with parameter offload
    moves = opt_off and not param_off and device.type == "cuda"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for rep in range(2):  # the first step creates Adam's state; the second is measured
            times = {}
            opt.zero_grad(set_to_none=True)
            sync(device)
            reset_peak(device)
            t0 = time.perf_counter()
            lp, _ = per_token_logprobs(model, micro, remove_padding=True)
            loss, _ = policy_losses.ppo_clip_loss(micro["old_log_probs"], lp, micro["advantages"], micro["response_mask"])
            loss.backward()
            sync(device)
            times["fwd_bwd_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            norm = clip_grad_norm(model, 1.0)
            sync(device)
            times["clip_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            if moves and rep:
                move_optimizer_state(opt, home)
            sync(device)
            times["state_in_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            opt.step()
            sync(device)
            times["step_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            if moves:
                move_optimizer_state(opt, "cpu")
            sync(device)
            times["state_out_s"] = time.perf_counter() - t0
            peak = peak_memory_gib(device)
    finally:
        torch.set_num_threads(threads)
    if not (math.isfinite(loss.item()) and math.isfinite(norm)):
        raise RuntimeError(f"non-finite loss {loss.item()} or gradient norm {norm}")
    mshape = model_shape(shape.path)
    valid = int(batch["attention_mask"].sum())
    estimate = sum(update_bytes(mshape, mshape.params, models.fsdp(param_off), 1, valid,
                                int(batch["response_mask"].sum()), True, mshape.vocab).values()) / 2**30
    per_param = (times["step_s"] + times["state_in_s"] + times["state_out_s"]) / mshape.params
    rank_step = per_param * full_params / 8
    total = sum(times.values())
    return {**times, "time_s": total, "tokens_per_s": valid / total, "peak_gib": peak,
            "plan_estimate_gib": estimate, "plan_over_measured": estimate / peak if peak else None,
            "optimizer_s_per_rank_step_7b": rank_step,
            "note": f"{work.offload_rows}x{2 * work.offload_len} tokens, 1 thread; fwd/bwd {times['fwd_bwd_s']:.2f} s, "
                    f"clip {times['clip_s']:.3f} s, state in/out {times['state_in_s']:.2f}/{times['state_out_s']:.2f} s, "
                    f"step {times['step_s']:.2f} s -> ~{rank_step:.1f} s per optimizer step for a 7B rank shard "
                    f"(x4 mini-batches a step); memory plan {estimate:.1f} GiB vs {peak:.1f} GiB measured"}


def host_adamw_s_per_param(probe: int = 2**24) -> tuple[float, float]:
    """Seconds per parameter of AdamW on this host with one thread (the update step's setting; the
    project's fused optimizer), timed on ``probe`` parameters: (the first step, which allocates and
    zeroes the state, a later step)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        p = torch.nn.Parameter(torch.zeros(probe))
        p.grad = torch.full_like(p, 1e-3)
        opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
        t0 = time.perf_counter()
        opt.step()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        opt.step()
        return first / probe, (time.perf_counter() - t0) / probe
    finally:
        torch.set_num_threads(threads)


def update_step_estimate_s(mode: str, params: int, k: float, host_rate: tuple[float, float]) -> float:
    """The update-step case's estimate: the device part (~20 s on a GPU) and, with parameter
    offload, its two AdamW steps on the host (the first creates the state) at the probed rate, a
    half more for clipping the host gradients and moving the weights."""
    base = 20 * k
    if UPDATE_MODES[mode][0]:
        base += params * sum(host_rate) * 1.5
    return base


def cases(models: Models, device: torch.device, work: Workload, smoke: bool) -> list[Case]:
    small, medium, large = (SMOKE_S, SMOKE_M, SMOKE_L) if smoke else (QWEN25_0_5B, QWEN25_1_5B, QWEN25_7B)
    plan_shape = SMOKE_PLAN if smoke else PLAN_LAYERS
    k = 0.1 if smoke else 1.0  # the smoke estimates: seconds on a 2-core CPU
    # first what decides the design: the 7B update step in each offload mode (host AdamW or not)
    step_shape = SMOKE_L if smoke else QWEN25_7B_4L
    host_rate = host_adamw_s_per_param()
    step_params = model_shape(step_shape.path).params
    out = [Case(f"7B update step, {mode}", step_shape.name, update_step_estimate_s(mode, step_params, k, host_rate),
                lambda m=mode: update_step_case(models, step_shape, work, device, m, 7_615_616_512))
           for mode in UPDATE_MODES]
    out += [Case("attention: packed, dense mask vs per sequence", "-", 5 * k, lambda: attention_case(device, work)),
           Case("tiny KL-PPO: 2 steps end to end (fit)", "tiny_klppo", 60 * k if not smoke else 15,
                lambda: tiny_klppo_case(device)),
           Case("tiny KL-PPO in bf16 (fit; flash-attn when installed)", "tiny_klppo", 60 * k if not smoke else 15,
                lambda: tiny_klppo_case(device, bf16=True)),
           Case("memory plan per phase: fit, bf16, 512-token responses", plan_shape.name, 90 * k if not smoke else 20,
                lambda: tiny_klppo_case(device, bf16=True, plan_shape=plan_shape, response_len=512 if not smoke else 32)),
           Case("preflight on this device (tiny_klppo, hf engine)", "tiny_klppo", 30 * k if not smoke else 10,
                lambda: preflight_case(device))]
    for shape, t in ((small, 1.0), (medium, 2.0)):
        out += [Case("actor update: packed+dynamic, AC off", shape.name, 25 * t * k,
                     lambda s=shape: actor_update_case(models, s, work, device, grad_ckpt=False)),
                Case("actor update: packed+dynamic, AC on", shape.name, 25 * t * k,
                     lambda s=shape: actor_update_case(models, s, work, device, grad_ckpt=True)),
                Case("actor update: packed+dynamic, AC off, varlen attn", shape.name, 30 * t * k,
                     lambda s=shape: actor_update_case(models, s, work, device, grad_ckpt=False, attn="varlen"))]
        if shape is small:
            out += [Case("reference log-prob forward", shape.name, 15 * t * k,
                         lambda s=shape: forward_case(models, s, work, device, critic=False)),
                    Case("critic value forward", shape.name, 15 * t * k,
                         lambda s=shape: forward_case(models, s, work, device, critic=True)),
                    Case("rollout: weight sync + hf generate", shape.name, 40 * t * k,
                         lambda s=shape: rollout_case(models, s, work, device))]
    out += [Case("7B-shape fwd/bwd micro-batch, offload off", large.name, 60 * k,
                 lambda: offload_case(models, large, work, device, offload=False)),
            Case("7B-shape fwd/bwd micro-batch, param+optim offload", large.name, 120 * k,
                 lambda: offload_case(models, large, work, device, offload=True)),
            Case("reference log-prob forward", medium.name, 30 * k,
                 lambda: forward_case(models, medium, work, device, critic=False)),
            Case("critic value forward", medium.name, 30 * k,
                 lambda: forward_case(models, medium, work, device, critic=True)),
            Case("rollout: weight sync + hf generate", medium.name, 60 * k,
                 lambda: rollout_case(models, medium, work, device)),
            Case("actor update: padded fixed micro-batches, AC off", small.name, 30 * k,
                 lambda: actor_update_case(models, small, work, device, grad_ckpt=False, packed=False))]
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
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    if dist.get_world_size() != 1:
        raise SystemExit(f"gpu_check measures one device: start it with one process, not {dist.get_world_size()}")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", help="folder for gpu_check.json and gpu_check.md (created)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget from start, seconds (default 420 on a GPU, 60 with --cpu-smoke)")
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
    budget = args.budget_s if args.budget_s is not None else (60.0 if args.cpu_smoke else 420.0)
    init_process_group(device)
    check = Check(Path(args.out_dir), budget, device, args.cpu_smoke, work)
    check.env = env_info(device, work)
    print(f"[gpu_check] {json.dumps(check.env)}", flush=True)
    for case in cases(Models(device), device, work, args.cpu_smoke):
        check.run(case)
    table = check.table()
    (check.out_dir / "gpu_check.md").write_text(table + "\n")
    check.write()
    env = check.env
    where = env.get("gpu") or f"CPU ({env.get('cpu_cores')} cores)"
    print(f"\n{where}, torch {env['torch']}, transformers {env['transformers']}, attention "
          f"{env['attn_implementation']}, bf16 matmul {env['matmul_bf16_tflops']:.1f} TFLOP/s measured, MFU against "
          f"{env['peak_tflops_assumed']:g} TFLOP/s; total {check.elapsed():.0f} s of a {budget:.0f} s budget")
    print(table, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if any(r["status"] == "error" for r in check.rows) else 0


if __name__ == "__main__":
    from rlhf_hpc.distributed.process_group import exit_process
    exit_process(main())
