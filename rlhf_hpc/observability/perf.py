"""Timers, model FLOPs and MFU, memory figures."""

from __future__ import annotations

import contextlib
import time
from typing import Optional

import torch

from rlhf_hpc.planning.hardware import device_hardware
from rlhf_hpc.planning.sizing import forward_flops, matmul_shape

__all__ = [
    "CPU_NOMINAL_FLOPS",
    "Timer",
    "memory_metrics",
    "model_flops",
    "peak_flops",
    "peak_flops_of",
    "peak_memory_bytes",
    "reset_peak_memory",
    "rss_bytes",
]

# CPU has no meaningful table entry; a nominal 1e11 FLOP/s per rank keeps the metric defined there
CPU_NOMINAL_FLOPS = 1e11


def peak_flops_of(device_name: str) -> float:
    """Dense bf16 peak FLOP/s (no sparsity) of a device as torch.cuda.get_device_name reports it: its
    entry in the hardware table (rlhf_hpc.planning.hardware), an H100-class part's where it has none
    (set hardware.bf16_tflops to be exact)."""
    return device_hardware(device_name).bf16_tflops * 1e12


def peak_flops(device: torch.device, override_tflops: Optional[float] = None) -> float:
    """Peak FLOP/s of one device: ``override_tflops`` (hardware.bf16_tflops) or the hardware table."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return CPU_NOMINAL_FLOPS
    return peak_flops_of(torch.cuda.get_device_name(device))


def model_flops(config, seq_lens, head_tokens: Optional[float] = None) -> float:
    """Forward FLOPs of a decoder (its transformers config) over sequences of ``seq_lens`` tokens,
    each attending only to itself, as packed sequences do (rlhf_hpc.planning.sizing.forward_flops on
    the config's matmul shape); the LM head on ``head_tokens`` tokens (default: all; training computes
    logits only where a response token is predicted).

    Backward is twice the forward; activation recomputation is not counted (model FLOPs, not
    hardware FLOPs), so MFU with checkpointing on measures the cost of the recompute too.
    """
    lens = [float(n) for n in seq_lens]
    tokens = sum(lens)
    head = tokens if head_tokens is None else float(head_tokens)
    shape = matmul_shape(config)
    return forward_flops(shape, tokens, 0.0, head, shape.vocab, square_sum=sum(n * n for n in lens))


class Timer:
    """``with timer("gen"):`` accumulates seconds under ``timing_s/gen``. Each phase is also a
    named range for profilers: ``record_function`` (torch.profiler traces) and NVTX on CUDA
    (Nsight Systems). With ``device``, each phase's peak memory goes under ``memory_gb/<phase>``
    (``peak_memory_bytes``: max_memory_allocated on a GPU, peak RSS on the CPU); nested phases
    keep their outer phase's peak, and the run's peak (``memory_metrics``) is kept across them."""

    def __init__(self, device: Optional[torch.device] = None):
        self.times: dict[str, float] = {}
        self.peaks: dict[str, float] = {}  # memory_gb/<phase>: the largest peak of its calls
        self.current = "step"  # the innermost phase running (named in out-of-memory reports)
        self.device = device
        self._open: list[int] = []  # the peak so far of each open phase, outermost first

    @contextlib.contextmanager
    def __call__(self, name: str):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        outer, self.current = self.current, name
        self._enter_peak()
        t0 = time.perf_counter()
        nvtx = torch.cuda.nvtx.range(name) if torch.cuda.is_available() else contextlib.nullcontext()
        try:
            with torch.profiler.record_function(f"phase/{name}"), nvtx:
                yield
            self.current = outer
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times[f"timing_s/{name}"] = self.times.get(f"timing_s/{name}", 0.0) + time.perf_counter() - t0
            self._exit_peak(name)

    def _enter_peak(self) -> None:
        if self.device is None:
            return
        if self._open:  # the outer phase's peak up to here, before the counter restarts for this one
            self._open[-1] = max(self._open[-1], peak_memory_bytes(self.device))
        reset_peak_memory(self.device)
        self._open.append(0)

    def _exit_peak(self, name: str) -> None:
        if self.device is None:
            return
        peak = max(self._open.pop(), peak_memory_bytes(self.device))
        if self._open:
            self._open[-1] = max(self._open[-1], peak)
        key = f"memory_gb/{name}"
        self.peaks[key] = max(self.peaks.get(key, 0.0), peak / 2**30)


# The run's peaks from before each reset_peak_memory (the counters only know the time since then)
_run_peaks: dict[str, int] = {}


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory since the last ``reset_peak_memory``: ``max_memory_allocated`` on a GPU (tensors
    only, no CUDA context), the process's peak resident memory (Linux VmHWM) on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _status_field("VmHWM")


def reset_peak_memory(device: torch.device) -> None:
    """Restart the peak counters at the current use, keeping the run's peak for ``memory_metrics``.
    CPU: writes 5 to /proc/self/clear_refs (VmHWM := VmRSS; Linux only)."""
    for key, value in _peaks_now(device).items():
        _run_peaks[key] = max(_run_peaks.get(key, 0), value)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peaks_now(device: torch.device) -> dict[str, int]:
    if device.type == "cuda":
        return {
            "perf/max_memory_allocated_gb": torch.cuda.max_memory_allocated(device),
            "perf/max_memory_reserved_gb": torch.cuda.max_memory_reserved(device),
        }
    return {"perf/max_memory_allocated_gb": _status_field("VmHWM")}


def memory_metrics(device: torch.device) -> dict[str, float]:
    """Resident memory now and the run's peaks (since the process started, across resets)."""
    out = {"perf/cpu_memory_used_gb": rss_bytes() / 2**30}
    for key, value in _peaks_now(device).items():
        out[key] = max(value, _run_peaks.get(key, 0)) / 2**30
    return out


def rss_bytes() -> int:
    """This process's resident memory now (Linux VmRSS; 0 where /proc is missing)."""
    return _status_field("VmRSS")


def _status_field(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
