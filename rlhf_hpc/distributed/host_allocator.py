"""Host memory that stays with the process: glibc's malloc, for CPU ranks, set to reuse freed
tensor memory instead of handing it back to the kernel and faulting it in again.

Why: by default glibc serves blocks above a few MiB with their own mmap, and returns a free heap
top above twice that to the kernel. A training step on the host frees and allocates the same
gradient, activation and logit buffers (1-32 MiB) over and over, and each new one costs a page
fault per 4 KiB it touches: in the issue-19 workload FSDP2's 16 MiB gradient copy-ins took
30-90 ms instead of 3, and the actor update took ~14,000 page faults per step. With these
settings blocks up to 32 MiB (glibc's maximum) come from the heap and up to 1 GiB of free heap is
kept. Not huge pages (``glibc.malloc.hugetlb=1``, which the ranks had before): side by side on
SmolLM2-135M's KL-PPO step they made steps 2-3 ~1.5x slower (BENCHMARKS.md).

The settings are glibc tunables, read when a process starts, so the launcher puts them in the
ranks' environment (``rlhf_hpc.launch.local.worker_env``). Where the user has chosen (``MALLOC_*``
or ``GLIBC_TUNABLES`` set, or an allocator preloaded), nothing is changed. Other C libraries
ignore the variable.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

__all__ = ["TUNABLES", "VALUE", "describe_malloc_settings", "malloc_tunables"]

TUNABLES = {
    "glibc.malloc.mmap_threshold": 32 << 20,  # glibc's largest allowed value on 64-bit
    "glibc.malloc.trim_threshold": 1 << 30,
    "glibc.malloc.top_pad": 64 << 20,
}
VALUE = ":".join(f"{k}={v}" for k, v in TUNABLES.items())
USER_SETTINGS = (
    "GLIBC_TUNABLES",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_ARENA_MAX",
)
PRELOADED = ("jemalloc", "tcmalloc", "mimalloc")
KEPT = "malloc keeps freed host memory: blocks up to 32 MiB from the heap, up to 1 GiB of it kept (GLIBC_TUNABLES)"


def malloc_tunables(env: Mapping[str, str]) -> tuple[Optional[str], str]:
    """(the ``GLIBC_TUNABLES`` value for CPU ranks started with ``env``, or None; why, in words)."""
    chosen = [k for k in USER_SETTINGS if env.get(k)]
    if chosen:
        return None, f"{', '.join(chosen)} set: malloc left as configured"
    preload = env.get("LD_PRELOAD", "")
    if any(name in preload for name in PRELOADED):
        return None, f"LD_PRELOAD={preload}: that allocator is used as it is"
    return VALUE, KEPT


def describe_malloc_settings(env: Mapping[str, str] = os.environ) -> str:
    """How this process (a rank) got its malloc settings, for the log."""
    if env.get("GLIBC_TUNABLES") == VALUE:
        return KEPT
    value, why = malloc_tunables(env)
    return "the C library's defaults (this rank was not started by the launcher)" if value else why
