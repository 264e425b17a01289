"""The GPU readiness check's shapes, workloads and measuring helpers (``rlhf_hpc.hardware_checks.gpu_check``)."""

from __future__ import annotations

import gc
import importlib.util
import math
import os
import platform
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from rlhf_hpc.config.schema import ActorConfig, CriticConfig, FSDPConfig, MixedPrecisionConfig
from rlhf_hpc.distributed.fsdp import parallelize
from rlhf_hpc.distributed.process_group import build_train_mesh
from rlhf_hpc.models.hf import attn_implementation, build_causal_lm, build_critic, model_config
from rlhf_hpc.observability.perf import memory_metrics, model_flops, peak_flops, peak_memory_bytes, reset_peak_memory
from rlhf_hpc.ops.batching import make_padded_batch
from rlhf_hpc.ppo.actor import Actor, ActorSpec
from rlhf_hpc.ppo.critic import Critic, CriticSpec
from rlhf_hpc.ppo.optim import build_optimizer
from rlhf_hpc.ppo.update import Placement

__all__ = [
    "GPU_WORK",
    "Models",
    "PLAN_LAYERS",
    "QWEN25_0_5B",
    "QWEN25_7B_4L",
    "SMOKE_L",
    "SMOKE_PLAN",
    "SMOKE_S",
    "SMOKE_WORK",
    "Shape",
    "Workload",
    "batch_flops",
    "env_info",
    "fixed_batch",
    "free_memory",
    "peak_memory_gib",
    "reset_peak",
    "rollout_batch",
    "sync",
    "timed",
    "used_memory_gib",
]


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
        return "tiny://qwen2?" + "&".join(
            f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in fields.items()
        )


# the layer shapes of the published Qwen2.5 config.json files (max_position_embeddings does not
# change the compute, so one value serves all)
QWEN25_0_5B = Shape("qwen2.5-0.5b", 151936, 896, 4864, 24, 14, 2, True)
# the 7B shape with 4 of its 28 layers: 2.0B parameters, whose fp32 weights, gradients and Adam
# state (32 GiB) fit one GPU in every offload mode; per-parameter costs carry over to the real run
QWEN25_7B_4L = Shape("qwen2.5-7b-4L", 152064, 3584, 18944, 4, 28, 4, False)
# smoke stand-ins: same roles (tied small models, an untied "large" one), head_dim 32
SMOKE_S = Shape("smoke-s", 512, 128, 256, 2, 4, 2, True, 10000.0, 1024)
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


GPU_WORK = Workload(
    rows=64,
    prompt=(128, 512),
    short=(64, 256),
    long=(512, 1024),
    max_token_len=16384,
    padded_micro=8,
    gen_prompts=64,
    gen_prompt_len=256,
    gen_tokens=256,
    offload_rows=4,
    offload_len=512,
    attn_seqs=16,
    attn_len=1024,
    matmul=8192,
    reps=2,
)
SMOKE_WORK = Workload(
    rows=8,
    prompt=(8, 24),
    short=(4, 8),
    long=(16, 24),
    max_token_len=96,
    padded_micro=4,
    gen_prompts=4,
    gen_prompt_len=8,
    gen_tokens=8,
    offload_rows=2,
    offload_len=16,
    attn_seqs=4,
    attn_len=32,
    matmul=256,
    reps=1,
)


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
        return FSDPConfig(
            fsdp_size=-1,
            param_offload=offload,
            optimizer_offload=offload,
            mixed_precision=MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32"),
        )

    def actor(
        self,
        shape: Shape,
        work: Workload,
        grad_ckpt: bool = False,
        offload: bool = False,
        train: bool = True,
        packed: bool = True,
        attn: str = "sdpa",
        optimizer_offload: Optional[bool] = None,
    ):
        model = build_causal_lm(shape.path, torch.float32, self.device, seed=0, attn=attn)
        if not train:
            model.requires_grad_(False)
        parallelize(
            model,
            build_train_mesh(self.device, 1, -1),
            self.fsdp(offload),
            self.device,
            gradient_checkpointing=grad_ckpt,
        )
        cfg = ActorConfig(
            ppo_mini_batch_size=work.rows,
            ppo_micro_batch_size_per_gpu=work.padded_micro,
            use_dynamic_bsz=packed,
            ppo_max_token_len_per_gpu=work.max_token_len,
            ppo_epochs=1,
            shuffle=False,
            clip_ratio_low=0.2,
            clip_ratio_high=0.2,
        )  # (resolve() fills these in runs)
        opt = build_optimizer(model, cfg.optim) if train else None
        opt_off = offload if optimizer_offload is None else optimizer_offload
        return Actor(
            model,
            cfg,
            ActorSpec(
                remove_padding=packed,
                optimizer=opt,
                optimizer_offload=opt_off and self.device.type == "cuda",
                placement=Placement(device=self.device),
            ),
        )

    def critic(self, shape: Shape):
        model = build_critic(shape.path, torch.float32, self.device, seed=1)
        model.requires_grad_(False)
        parallelize(model, build_train_mesh(self.device, 1, -1), self.fsdp(), self.device)
        return Critic(
            model,
            CriticConfig(
                use_dynamic_bsz=True, forward_max_token_len_per_gpu=32768, shuffle=False, loss_agg_mode="token-mean"
            ),
            CriticSpec(remove_padding=True, placement=Placement(device=self.device)),
        )


# ------------------------------------------------------------------------------------ the machine
def env_info(device: torch.device, work: Workload) -> dict:
    """The versions, the device and the settings the figures were measured with."""
    import transformers  # (seconds to import: the check's report only)

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "vllm_installed": importlib.util.find_spec("vllm") is not None,
        "flash_attn_installed": importlib.util.find_spec("flash_attn") is not None,
        "attn_implementation": attn_implementation(device),
        "peak_tflops_assumed": peak_flops(device) / 1e12,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        nccl = torch.cuda.nccl.version()  # a tuple in recent releases, an int in old ones
        info.update(
            gpu=props.name,
            gpu_memory_gib=props.total_memory / 2**30,
            cuda=torch.version.cuda,
            nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
            bf16=torch.cuda.is_bf16_supported(),
            sm_count=props.multi_processor_count,
        )
    else:
        info.update(cpu_cores=os.cpu_count(), threads=torch.get_num_threads())
    n = work.matmul
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    secs, _ = timed(lambda: a @ b, device, 5)
    info["matmul_bf16_tflops"] = 2 * n**3 / secs / 1e12
    return info
