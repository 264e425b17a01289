"""Host memory for CPU ranks (rlhf_hpc.distributed.host_allocator): the launcher's environment for the ranks, and
what the settings do to page faults when a step frees and allocates the same buffers again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlhf_hpc.distributed.host_allocator import VALUE, describe_malloc_settings, malloc_tunables
from rlhf_hpc.launch.local import worker_env
from rlhf_hpc.recipe.load import load_config

# 10 rounds of four 16 MiB tensors written and freed (the sizes of a step's gradient copy-ins), after
# 8 rounds that let the heap reach its size
ROUNDS = """
import resource, torch
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for r in range(18):
    if r == 8: f0 = faults()
    bufs = [torch.empty(4 << 20).fill_(1.0) for _ in range(4)]
    del bufs
print(faults() - f0)
"""


def _clean_env() -> dict:
    return {
        k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD") and not k.startswith("MALLOC_")
    }


def test_cpu_ranks_get_the_settings_unless_the_user_chose(monkeypatch):
    cfg = load_config("tiny_klppo", [])[0]
    for k in ("GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_ARENA_MAX"):
        monkeypatch.delenv(k, raising=False)
    assert worker_env(cfg)["GLIBC_TUNABLES"] == VALUE
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert worker_env(cfg)["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"  # the user's, untouched
    assert malloc_tunables(os.environ) == (None, "GLIBC_TUNABLES set: malloc left as configured")
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert "GLIBC_TUNABLES" not in worker_env(cfg)
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert "GLIBC_TUNABLES" not in worker_env(cfg)
    monkeypatch.delenv("LD_PRELOAD")
    cfg.trainer.device = "cuda"  # GPU ranks keep the C library's defaults
    assert "GLIBC_TUNABLES" not in worker_env(cfg)
    # what a rank logs
    assert describe_malloc_settings({"GLIBC_TUNABLES": VALUE}).startswith("malloc keeps freed host memory")
    assert describe_malloc_settings({}) == "the C library's defaults (this rank was not started by the launcher)"


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc: Linux only")
def test_freed_buffers_are_reused_without_page_faults():
    """A 16 MiB block glibc serves by mmap goes back to the kernel when freed and is faulted in
        again, 4 KiB at a time: 163,880 faults over 10 rounds of four, with glibc's mmap threshold held
        at its 128 KiB default. glibc's own defaults raise that threshold after the first such free, on
        some runs and not others (0 or ~28,600 faults here). With the ranks' settings the blocks come
        from the heap, which grows in the first rounds and is then reused: none. (The heap grew until the
    third or fifth round in 12 runs here, the blocks placed around each other: counting from the fifth
    failed a third of the runs, with one round's 16,384 faults.)"""

    def faults(tunables: str) -> int:
        env = {**_clean_env(), "GLIBC_TUNABLES": tunables}
        out = subprocess.run([sys.executable, "-c", ROUNDS], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1])

    returned = faults("glibc.malloc.mmap_threshold=131072")
    assert returned > 10 * 4 * (16 << 20) // 4096 // 2  # each round's blocks faulted in again
    assert faults(VALUE) < returned / 100


def test_gpu_ranks_get_nccl_without_cumem_unless_the_user_chose(monkeypatch):
    """vLLM's sleep mode remaps memory through CUDA's virtual-memory API; NCCL buffers allocated
    through it have crashed colocated engines (verl sets the same)."""
    cfg, _ = load_config("qwen7b_klppo", check_files=False)
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    assert worker_env(cfg)["NCCL_CUMEM_ENABLE"] == "0"
    assert "NCCL_CUMEM_ENABLE" not in worker_env(load_config("tiny_klppo")[0])  # CPU ranks: no NCCL
    auto, _ = load_config("qwen7b_klppo", ["trainer.device=auto"], check_files=False)
    assert worker_env(auto)["NCCL_CUMEM_ENABLE"] == "0"  # auto: GPU ranks wherever there is a GPU
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")
    assert worker_env(cfg)["NCCL_CUMEM_ENABLE"] == "1"  # the user's choice stays


def test_a_tensor_parallel_engine_with_sleep_mode_all_reduces_through_nccl_only(monkeypatch):
    """vLLM's disable_custom_all_reduce leaves its symmetric-memory and FlashInfer all-reduces on
    (both default on); under sleep mode with TP > 1 the ranks turn them off, unless the user chose."""
    names = ("VLLM_ALLREDUCE_USE_SYMM_MEM", "VLLM_ALLREDUCE_USE_FLASHINFER")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    tp = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    two, _ = load_config("qwen7b_klppo", [f"{tp}=2"], check_files=False)
    assert all(worker_env(two)[n] == "0" for n in names)
    one, _ = load_config("qwen7b_klppo", [f"{tp}=1"], check_files=False)
    awake, _ = load_config(
        "qwen7b_klppo", [f"{tp}=2", "actor_rollout_ref.rollout.free_cache_engine=false"], check_files=False
    )
    assert not any(n in worker_env(one) or n in worker_env(awake) for n in names)
    monkeypatch.setenv("VLLM_ALLREDUCE_USE_FLASHINFER", "1")
    assert worker_env(two)["VLLM_ALLREDUCE_USE_FLASHINFER"] == "1"
    try:  # the names are vLLM's (a rename would leave them without effect)
        from vllm import envs
    except ImportError:
        return
    assert all(n in envs.environment_variables for n in names)
