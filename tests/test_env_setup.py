"""env/setup.sh: idempotent, refuses unknown profiles, and the venv it built is the CPU one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, require

SETUP = REPO / "env" / "setup.sh"


def _running_in_setup_venv() -> bool:
    return (Path(sys.prefix) / ".rlhf-hpc-setup").is_file()


@pytest.mark.slow
def test_second_run_is_a_fast_no_op():
    """In the CPU seconds of the run (0.08 measured, a real install is minutes of them), which
    another worker's load leaves as they are: no `exclusive` wait needed."""
    import resource

    require(
        "a venv built by env/setup.sh",
        _running_in_setup_venv(),
        f"tests run from {sys.prefix}, not from a venv env/setup.sh made",
    )
    env = dict(os.environ, RLHF_HPC_VENV=sys.prefix)

    def children_cpu_s() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    before = children_cpu_s()
    out = subprocess.run(["bash", str(SETUP), "cpu"], env=env, capture_output=True, text=True, timeout=60)
    spent = children_cpu_s() - before
    assert out.returncode == 0, out.stderr
    assert "is up to date (cpu profile); nothing to do" in out.stdout
    assert spent < 5, f"a no-op run took {spent:.1f} CPU seconds"


def test_cpu_venv_has_no_cuda_torch_and_no_vllm_breakers():
    require("a venv built by env/setup.sh", _running_in_setup_venv())
    import importlib.util

    import torch

    assert torch.version.cuda is None and torch.__version__ == "2.13.0+cpu"
    for name in ("torchvision", "torchaudio", "torchcodec", "triton"):
        assert importlib.util.find_spec(name) is None, f"{name} breaks 'import vllm' on CPU"


@pytest.mark.slow
def test_unknown_profile_is_refused(tmp_path):
    env = dict(os.environ, RLHF_HPC_VENV=str(tmp_path / "venv"))
    out = subprocess.run(["bash", str(SETUP), "tpu"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "unknown profile 'tpu'; use one of: cpu, gpu, auto" in out.stderr
    assert not (tmp_path / "venv").exists()


# ---------------------------------------------------------------- the gpu profile's driver branches
def _fake_nvidia_smi(bin_dir: Path, driver: str | None) -> None:
    """An ``nvidia-smi`` that answers as a node with one H100 and the given driver (None: no GPU)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    listing = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)" if driver else ""
    smi.write_text(
        f'#!/bin/sh\ncase "$*" in *driver_version*) echo "{driver or ""}" ;; *-L*) echo "{listing}" ;; esac\n'
    )
    smi.chmod(0o755)


def _plan(tmp_path: Path, driver: str | None, profile: str = "gpu", **env_vars: str):
    """``env/setup.sh PROFILE --print-plan`` on a PATH whose nvidia-smi is the fake one (or none)."""
    bin_dir = tmp_path / "bin"
    if driver is not None:
        _fake_nvidia_smi(bin_dir, driver)
    path = os.pathsep.join(
        [str(bin_dir)] + [p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "nvidia-smi").exists()]
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLHF_HPC_")}
    env.update(PATH=path, RLHF_HPC_VENV=str(tmp_path / "venv"), **env_vars)
    out = subprocess.run(
        ["bash", str(SETUP), profile, "--print-plan"], env=env, capture_output=True, text=True, timeout=60
    )
    assert not (tmp_path / "venv").exists()  # a plan installs nothing
    return out


@pytest.mark.slow
def test_a_driver_of_r580_or_newer_gets_the_cuda13_build(tmp_path):
    """PyPI's vLLM 0.33.0 and torch 2.14.0 (their CUDA 13 builds: env/README.md), then FlashInfer's kernels."""
    for driver in ("580.95.05", "590.44.01"):
        out = _plan(tmp_path, driver)
        assert out.returncode == 0, out.stderr
        assert f"driver {driver} -> CUDA 13.0 build of vLLM 0.33.0 (cu130)" in out.stdout
        assert "plan: pip install vllm==0.33.0 torch==2.14.0\n" in out.stdout
        assert "plan: vllm download-kernels" in out.stdout
        assert "download.pytorch.org" not in out.stdout and "minor-version" not in out.stdout


@pytest.mark.slow
def test_drivers_r525_to_r579_get_the_newest_vllm_with_a_cuda12_build(tmp_path):
    """vLLM 0.33 has no CUDA 12 build: 0.26.0+cu129 from vLLM's per-release index, torch 2.11.0 from
    PyTorch's cu129 index (no +cu128 asset exists, so no release URL of one is ever named)."""
    for driver, compat in (
        ("575.57.08", False),
        ("570.133.20", True),
        ("550.163.01", True),
        ("535.104.05", True),
        ("525.60.13", True),
    ):
        out = _plan(tmp_path, driver)
        assert out.returncode == 0, out.stderr
        assert f"driver {driver} -> CUDA 12.9 build of vLLM 0.26.0 (cu129)" in out.stdout
        assert (
            "plan: pip install vllm==0.26.0+cu129 torch==2.11.0 --extra-index-url https://wheels.vllm.ai/0.26.0/cu129"
            " --extra-index-url https://download.pytorch.org/whl/cu129\n"
        ) in out.stdout
        assert "vLLM 0.33.0 has no CUDA 12 build" in out.stdout and "download-kernels" not in out.stdout
        assert "cu128" not in out.stdout and "github.com" not in out.stdout
        assert ("minor-version compatibility" in out.stdout) is compat, (driver, out.stdout)
    out = _plan(tmp_path, "550.163.01", RLHF_HPC_VLLM_WHEEL="/mirror/vllm-0.26.0+cu129-cp38-abi3-x.whl")
    assert "plan: pip install /mirror/vllm-0.26.0+cu129-cp38-abi3-x.whl torch==2.11.0" in out.stdout


@pytest.mark.slow
def test_a_driver_older_than_r525_stops_with_the_fix(tmp_path):
    out = _plan(tmp_path, "470.256.02")
    assert out.returncode == 1 and "plan:" not in out.stdout
    assert "NVIDIA driver 470.256.02 supports CUDA 11.x at most" in out.stderr
    assert "Ask the site for driver R525+" in out.stderr


@pytest.mark.slow
def test_no_driver_stops_unless_the_build_is_named(tmp_path):
    out = _plan(tmp_path, None)
    assert out.returncode == 1 and "nvidia-smi not found" in out.stderr and "RLHF_HPC_CUDA=12.9" in out.stderr
    out = _plan(tmp_path, "")  # nvidia-smi present, no GPU listed
    assert out.returncode == 1 and "lists no GPU" in out.stderr
    out = _plan(tmp_path, None, RLHF_HPC_CUDA="12.9")  # the container build
    assert out.returncode == 0, out.stderr
    assert "RLHF_HPC_CUDA=12.9 -> CUDA 12.9 build of vLLM 0.26.0" in out.stdout and "driver not asked" in out.stdout
    out = _plan(tmp_path, None, RLHF_HPC_CUDA="12.8")  # the old name: no such build exists
    assert out.returncode == 1 and "vLLM publishes no cu128 build" in out.stderr and "RLHF_HPC_CUDA=12.9" in out.stderr
    out = _plan(tmp_path, "580.95.05", RLHF_HPC_CUDA="12.4")
    assert out.returncode == 1 and "RLHF_HPC_CUDA='12.4': use 12.9 or 13.0" in out.stderr


@pytest.mark.slow
def test_a_python_older_than_3_11_is_refused_by_name(tmp_path):
    """vLLM needs 3.11: said before pip runs, for both profiles, naming the interpreter's version."""
    fake = tmp_path / "python3.10"
    fake.write_text('#!/bin/sh\ncase "$*" in *sys.exit*) exit 1 ;; *python_version*) echo 3.10.14 ;; esac\n')
    fake.chmod(0o755)
    for profile in ("cpu", "gpu"):
        out = _plan(tmp_path, "580.95.05", profile=profile, PYTHON=str(fake))
        assert out.returncode == 1 and "plan:" not in out.stdout
        assert f"{fake} is Python 3.10.14; rlhf-hpc needs Python 3.11 or newer" in out.stderr


@pytest.mark.slow
def test_flash_attn_is_opt_in(tmp_path):
    out = _plan(tmp_path, "580.95.05")
    assert "flash-attn: not installed (set RLHF_HPC_FLASH_ATTN=1" in out.stdout and "varlen" in out.stdout
    assert "plan: pip install --no-build-isolation" not in out.stdout
    out = _plan(tmp_path, "580.95.05", RLHF_HPC_FLASH_ATTN="1")
    assert "plan: pip install --no-build-isolation 'flash-attn>=2.7'" in out.stdout


@pytest.mark.slow
def test_auto_profile_follows_the_driver(tmp_path):
    out = _plan(tmp_path, "570.133.20", profile="auto")
    assert out.returncode == 0 and "auto-detected profile: gpu" in out.stdout and "(cu129)" in out.stdout
    out = _plan(tmp_path / "nogpu", None, profile="auto")
    assert out.returncode == 0 and "auto-detected profile: cpu" in out.stdout and "torch==2.13.0+cpu" in out.stdout


def test_the_container_and_the_profile_name_the_same_cuda():
    """The image builds the CUDA 12.9 variant (every driver from R525) against its own nvcc 12.9
    (flash-attn compiles with it)."""
    definition = (REPO / "env" / "rlhf-hpc-gpu.def").read_text()
    assert "From: nvidia/cuda:12.9.1-cudnn-devel-ubuntu22.04" in definition and "RLHF_HPC_CUDA=12.9" in definition
    assert "module load cuda/12.9" in (REPO / "slurm" / "clusters" / "example-gpu.yaml").read_text()
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    from rlhf_hpc.recipe.packages import VLLM_BELOW, VLLM_MIN

    assert f"vllm>={VLLM_MIN},<{VLLM_BELOW}" in cfg["options.extras_require"]["gpu"]
    assert "flash-attn" not in cfg["options.extras_require"]["gpu"]
    setup = SETUP.read_text()
    vllm_gpu = next(line.split("=")[1] for line in setup.splitlines() if line.startswith("VLLM_GPU="))
    from packaging.version import Version

    vllm_cu12 = next(line.split("=")[1] for line in setup.splitlines() if line.startswith("VLLM_CU12="))
    assert Version(VLLM_MIN) <= Version(vllm_cu12) < Version(vllm_gpu) < Version(VLLM_BELOW)
    assert cfg["options"]["python_requires"].strip() == ">=3.11"
