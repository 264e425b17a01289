"""env/setup.sh: idempotent, refuses unknown profiles, and the venv it built is the CPU one."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO, require

SETUP = REPO / "env" / "setup.sh"


def _running_in_setup_venv() -> bool:
    return (Path(sys.prefix) / ".rlhf-hpc-setup").is_file()


def test_second_run_is_a_fast_no_op():
    require("a venv built by env/setup.sh", _running_in_setup_venv(),
            f"tests run from {sys.prefix}, not from a venv env/setup.sh made")
    env = dict(os.environ, RLHF_HPC_VENV=sys.prefix)
    t0 = time.monotonic()
    out = subprocess.run(["bash", str(SETUP), "cpu"], env=env, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    assert "is up to date (cpu profile); nothing to do" in out.stdout
    assert elapsed < 5, f"a no-op run took {elapsed:.1f} s"


def test_cpu_venv_has_no_cuda_torch_and_no_vllm_breakers():
    require("a venv built by env/setup.sh", _running_in_setup_venv())
    import importlib.util

    import torch
    assert torch.version.cuda is None and torch.__version__ == "2.13.0+cpu"
    for name in ("torchvision", "torchaudio", "torchcodec", "triton"):
        assert importlib.util.find_spec(name) is None, f"{name} breaks 'import vllm' on CPU"


def test_unknown_profile_is_refused(tmp_path):
    env = dict(os.environ, RLHF_HPC_VENV=str(tmp_path / "venv"))
    out = subprocess.run(["bash", str(SETUP), "tpu"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "unknown profile 'tpu'; use one of: cpu, gpu, auto" in out.stderr
    assert not (tmp_path / "venv").exists()
