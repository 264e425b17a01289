"""The dry run's checks of the ``sandbox`` and ``reward_model.sandbox_fusion`` keys, for a run that
executes code (a code reward's rows, a code tool): the limits, whether a sandbox runs programs on
this machine (with the fix where none does), and what bounds a program's memory here."""

from __future__ import annotations

import os
from urllib.parse import urlparse

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.schema import Config
from rlhf_hpc.tools.memory_bound import MEMORY_BOUNDS, memory_bound
from rlhf_hpc.tools.sandbox import SandboxUnavailable, describe, sandbox_backend

__all__ = ["sandbox_problems"]

MIN_MEMORY_MB = 64  # below this no Python interpreter starts


def sandbox_problems(cfg: Config) -> tuple[list[str], list[str], list[str]]:
    """(errors, warnings, notes). Runs one small program in the sandbox when the service is not
    configured: the answer is this machine's; a job's nodes may differ (each rank's first program
    prints its own line). ``notes``: where programs run here and what bounds their memory."""
    sb, fusion = cfg.sandbox, cfg.reward_model.sandbox_fusion
    errors, warnings = [], []
    for key, value, least in (
        ("timeout_s", sb.timeout_s, 0.1),
        ("memory_mb", sb.memory_mb, MIN_MEMORY_MB),
        ("process_memory_mb", sb.process_memory_mb, MIN_MEMORY_MB),
        ("max_processes", sb.max_processes, 1),
        ("max_file_mb", sb.max_file_mb, 1),
        ("max_output_kb", sb.max_output_kb, 1),
        ("max_parallel", sb.max_parallel, 1),
    ):
        if value < least:
            errors.append(f"sandbox.{key}={value}: must be at least {least:g}")
    if sb.memory_bound not in MEMORY_BOUNDS:
        errors.append(f"sandbox.memory_bound={sb.memory_bound}: expected one of {', '.join(MEMORY_BOUNDS)}")
    if fusion.url:
        url = urlparse(fusion.url)
        if url.scheme not in ("http", "https") or not url.netloc:
            errors.append(f"reward_model.sandbox_fusion.url={fusion.url}: expected http(s)://host[:port]/run_code")
        if fusion.max_concurrent < 1 or fusion.memory_limit_mb < MIN_MEMORY_MB:
            errors.append(
                f"reward_model.sandbox_fusion.max_concurrent={fusion.max_concurrent} / memory_limit_mb="
                f"{fusion.memory_limit_mb}: must be >= 1 / >= {MIN_MEMORY_MB}"
            )
        return errors, warnings, []  # programs run on the service: the sandbox here is not used
    if errors:
        return errors, warnings, []  # the probe would run under limits already refused
    try:
        backend, mode = sandbox_backend(sb)
    except ConfigError as e:  # an unknown backend name
        return [str(e)], warnings, []
    except SandboxUnavailable as e:
        return [f"{e} (checked on this machine)"], warnings, []
    if backend.weak:
        warnings.append(
            f"sandbox.backend={sb.backend}: {backend.note}; the time, memory, process, file and "
            f"output limits hold, but a program can read what you can and reach the network"
        )
    if mode == "userns" and os.geteuid() == 0:
        held = (
            ""
            if memory_bound(sb, backend.tmpfs).kind == "cgroup"
            else ", nor does the rlimits memory bound (processes x memory)"
        )
        warnings.append(
            "the sandbox runs as root in a user namespace (privileged bwrap failed here): "
            f"sandbox.max_processes does not hold for root{held}; a fork bomb is stopped at "
            "sandbox.timeout_s only"
        )
    return (
        errors,
        warnings,
        [f"{describe(sb, backend, mode)} (this machine; each rank prints its own at its first program)"],
    )
