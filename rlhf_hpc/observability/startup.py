"""Where a rank's start-up goes: the seconds of each phase from the worker's first line to its first
step (imports, the config, the process group, the data, the models, the engine, the resume, the
trackers), logged once by the main rank and as ``timing_s/startup/<phase>`` in the first step's metrics."""

from __future__ import annotations

import os
import time

__all__ = ["StartupClock", "process_started"]


def process_started() -> float:
    """This process's start on the boot-time clock (Linux: /proc/self/stat), so the first phase
    counts the interpreter and the imports; now where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:  # (field 22, after the parenthesised name: start, in clock ticks)
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.clock_gettime(time.CLOCK_BOOTTIME)


class StartupClock:
    """Phases marked in order, from the process's start: each one's seconds are the time since the
    previous mark."""

    def __init__(self):
        self.last = process_started()
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.clock_gettime(time.CLOCK_BOOTTIME)
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
        self.last = now

    @property
    def total(self) -> float:
        return sum(self.phases.values())

    def line(self) -> str:
        return (
            f"start-up {self.total:.1f} s: "
            + ", ".join(f"{k} {v:.1f}" for k, v in self.phases.items())
            + " (this rank; the first weight sync is step 1's update_weights)"
        )

    def metrics(self) -> dict[str, float]:
        return {
            **{f"timing_s/startup/{k.replace(' ', '_')}": v for k, v in self.phases.items()},
            "timing_s/startup/total": self.total,
        }
