"""The first local CPU run on a machine measures the machine before it plans.

The nominal CPU figures (``planning/hardware.uncalibrated_cpu``) are an order of magnitude: on the
VMs this project runs on they put the quick start's real GRPO step 2-2.6x too slow, and the layout
chooser decides by that plan. So a local CPU run that would plan with them, because the default
calibration file does not exist, first runs the calibration bench once (``python -m
rlhf_hpc.hardware_checks.calibrate``, about a minute; it writes the file atomically), and the run, its
layout and its plans, is resolved again with the measured figures. ``hardware.first_run_calibration
=false`` skips it; Slurm jobs are planned where they are submitted, away from the nodes that run
them, so they never calibrate the login node's CPU.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.planning.hardware import calibration_path, plans_this_cpu

__all__ = ["calibrate_first_run", "dry_run_note", "needs_first_calibration"]


def needs_first_calibration(cfg) -> bool:
    """A local run whose time plan would read this CPU's default calibration file, which is not there."""
    if cfg.launcher.cluster != "local" or not cfg.hardware.first_run_calibration:
        return False
    if not plans_this_cpu(cfg) or cfg.hardware.calibration is not None:
        return False
    if cfg.trainer.device == "auto":
        import torch  # (already imported by the config's loading; auto on a GPU machine is a GPU run)

        if torch.cuda.is_available():
            return False
    return not calibration_path().is_file()


def dry_run_note(cfg) -> str | None:
    """The dry run's comment line when the launch would calibrate first."""
    if not needs_first_calibration(cfg):
        return None
    return (
        f"# no calibration file for this CPU ({calibration_path()}): the plans below use nominal figures; "
        f"the run measures this machine first (about a minute, once) and plans with what it measures "
        f"(hardware.first_run_calibration=false skips it)"
    )


def calibrate_first_run(cfg) -> Path:
    """Run the calibration bench with the run's ranks; its output goes to ``cpu.log`` beside the
    file. A failure is a ConfigError naming the log and both ways on."""
    out = calibration_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log")
    ranks = max(1, cfg.trainer.n_gpus_per_node)
    cmd = [sys.executable, "-m", "rlhf_hpc.hardware_checks.calibrate", "--ranks", str(ranks), "--out", str(out)]
    if importlib.util.find_spec("vllm") is None:  # the engine's figures keep their defaults
        cmd.append("--skip-vllm")
    print(
        f"[rlhf-hpc] no calibration file for this CPU: measuring it once before the first run "
        f"(about a minute; log {log})",
        flush=True,
    )
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0 or not out.is_file():
        raise ConfigError(
            f"the first run's calibration of this CPU failed (exit code {rc}; log {log}). "
            f"Run it alone to see why: {' '.join(cmd[1:])}; or plan with the nominal figures: "
            f"hardware.first_run_calibration=false"
        )
    print(f"[rlhf-hpc] calibrated this CPU in {time.perf_counter() - t0:.0f} s: {out}", flush=True)
    return out
