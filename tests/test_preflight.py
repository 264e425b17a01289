"""``launch.py preflight``: the allocation check (rlhf_hpc/preflight.py) end to end on this machine's
2 CPU ranks (gloo, vLLM's CPU build): every check passes on a healthy setup, a broken weight sync
fails it with its cause and key and exit code 2. Through Slurm: tests/test_slurm.py."""

from __future__ import annotations

import importlib.util

import pytest

from rlhf_hpc.config.tree import parse_yaml
from rlhf_hpc.preflight import BUSBW_FLOOR_GBPS, Check, interconnect
from tests.conftest import require, run_launch

CHECKS = [
    "process group",
    "bandwidth replicate",
    "rollout engine",
    "weight sync",
    "generation",
    "sleep/wake",
    "actor micro-batch",
]


def lines_of(stdout: str) -> list[str]:
    prefix = "[rlhf-hpc] preflight: "
    return [line[len(prefix) :] for line in stdout.splitlines() if line.startswith(prefix)]


@pytest.fixture(scope="module")
def vllm():
    require("vLLM", importlib.util.find_spec("vllm") is not None, "install the cpu profile (env/setup.sh cpu)")


@pytest.mark.slow
def test_a_healthy_allocation_passes_every_check(vllm, tmp_path):
    out = run_launch(
        "preflight",
        "recipe=tiny_klppo",
        f"trainer.default_local_dir={tmp_path}",
        "actor_rollout_ref.rollout.name=vllm",
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = lines_of(out.stdout)
    assert [line[5:].split("  ")[0].strip() for line in lines] == CHECKS, lines
    assert [line[:4] for line in lines] == ["OK  "] * 5 + ["SKIP", "OK  "], lines
    run = tmp_path / "preflight"  # beside the run's own directory, never in it
    assert (run / "preflight.txt").read_text().splitlines() == lines + ["preflight passed"]
    assert f"[rlhf-hpc] preflight passed: 7 checks ({run / 'preflight.txt'})" in out.stdout
    cfg = parse_yaml((run / "config.yaml").read_text())
    assert cfg["trainer"]["preflight"] is True and cfg["launcher"]["time_min"] == 30
    assert not list(tmp_path.glob("global_step_*")) and not list(run.glob("global_step_*"))  # nothing trained
    bandwidth = next(line for line in lines if "bandwidth" in line)
    gbps = [float(w) for w in bandwidth.replace(",", " ").split() if w.replace(".", "").isdigit() and "." in w]
    assert len(gbps) == 2 and min(gbps) >= BUSBW_FLOOR_GBPS["one host (gloo)"], bandwidth
    generation = next(line for line in lines if line[5:].startswith("generation"))
    assert "(float32)" in generation and "limit 0.001" in generation
    sync = next(line for line in lines if line[5:].startswith("weight sync"))
    assert "(time plan " in sync and "x)" in sync, sync  # measured against the plan's update_weights
    micro = next(line for line in lines if "micro-batch" in line)
    assert "4 rows x 40 tokens" in micro and "x;" in micro  # tiny_klppo: 4 per GPU, 32 + 8 tokens; a ratio


@pytest.mark.slow
def test_a_broken_weight_sync_fails_with_its_cause_and_key(vllm, tmp_path):
    # the fault seam's wrong_weights@0: the preflight's sync sends every tensor x1.5
    out = run_launch(
        "preflight",
        "recipe=tiny_klppo",
        f"trainer.default_local_dir={tmp_path}",
        "actor_rollout_ref.rollout.name=vllm",
        "trainer.inject_fault=wrong_weights@0",
        timeout=600,
    )
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    lines = lines_of(out.stdout)
    assert lines[-1].startswith("FAIL generation") and "actor micro-batch" not in out.stdout  # stops there
    error = out.stderr.strip().splitlines()[-1]
    assert error.startswith("error: preflight failed: generation: ") and "actor_rollout_ref.rollout.dtype" in error
    report = (tmp_path / "preflight" / "preflight.txt").read_text().splitlines()
    assert report[-2] == lines[-1] and report[-1].startswith("preflight failed: generation")


@pytest.mark.slow
def test_the_dry_run_shows_the_preflight_job(tmp_path):
    out = run_launch(
        "preflight",
        "recipe=qwen7b_klppo",
        "cluster=slurm",
        "launcher.cluster_profile=example-gpu",
        "--dry-run",
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = parse_yaml(out.stdout.split("# sbatch script")[0])
    assert cfg["trainer"]["preflight"] is True and cfg["trainer"]["experiment_name"].endswith("_preflight")
    assert cfg["trainer"]["default_local_dir"].endswith("/preflight") and cfg["launcher"]["time_min"] <= 30
    assert "--time=30" in out.stdout or "--time=00:30:00" in out.stdout or "time=30" in out.stdout
    refused = run_launch("preflight", "recipe=tiny_klppo", "sweep.actor_rollout_ref.actor.optim.lr=[1e-3,1e-4]")
    assert refused.returncode == 2 and "no sweeps" in refused.stderr


def test_interconnects_are_named_by_where_the_ranks_are():
    import torch

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert interconnect([0, 1], ["a", "a"], cpu) == "one host (gloo)"
    assert interconnect([0, 2], ["a", "a", "b", "b"], cpu) == "network (gloo)"
    assert interconnect([2, 3], ["a", "a", "b", "b"], gpu) in ("NVLink", "PCIe")  # one host: NVML decides
    assert interconnect([0, 2], ["a", "a", "b", "b"], gpu) in ("InfiniBand", "Ethernet")
    assert set(BUSBW_FLOOR_GBPS) >= {"NVLink", "PCIe", "InfiniBand", "Ethernet", "one host (gloo)", "network (gloo)"}
    line = Check("bandwidth shard", False, "x", "keep it inside a node").line()
    assert line == f"FAIL {'bandwidth shard':<20} x; fix: keep it inside a node"
    assert Check("sleep/wake", None, "no sleep mode", "unused").line() == f"SKIP {'sleep/wake':<20} no sleep mode"
