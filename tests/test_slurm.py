"""Slurm launching against a real local Slurm (``slurm/dev-cluster.sh up [--nodes N]``; .ci/run starts it).

Jobs here run the tiny recipe on one 2-CPU node of it: submission and completion, USR2
preemption -> checkpoint -> requeue -> bit-identical resume, a time limit shorter than the run,
and bad requests refused before anything is queued. The dry-run sbatch texts are pinned by golden
files. Sweeps and multi-node jobs (real separate hosts): test_slurm_multinode.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_hpc.observability.tracking import read_metrics
from tests.conftest import REPO, launch_here, require, run_launch

TINY = [
    "recipe=tiny_klppo",
    "cluster=slurm",
    "launcher.cluster_profile=local",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
]
# (plan/: the time plan, which depends on the layout: 2 nodes x 1 rank is not 1 node x 2 ranks)
NONDETERMINISTIC = ("timing_s/", "perf/", "memory_gb/", "plan/")


def slurm_up() -> bool:
    if shutil.which("sbatch") is None:
        return False
    out = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    return "is UP" in out.stdout


@pytest.fixture
def slurm():
    require("a running Slurm", slurm_up(), "start it with: bash slurm/dev-cluster.sh up")


def job_ids(run: Path) -> list[str]:
    return [r["job_id"] for r in json.loads((run / "slurm_jobs.json").read_text())]


def state(job_id: str) -> str:
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True, text=True)
    states = out.stdout.split()
    return states[-1] if states else "UNKNOWN"


def wait_done(job_id: str, timeout: float = 600) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = state(job_id)
        queued = subprocess.run(["squeue", "-h", "-j", job_id.split("_")[0]], capture_output=True, text=True).stdout
        if s in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL") and not queued.strip():
            return s
        time.sleep(3)
    subprocess.run(["scancel", job_id.split("_")[0]])
    raise AssertionError(f"job {job_id} not done after {timeout} s (state {state(job_id)})")


def raw_steps(run: Path) -> list[int]:
    return [json.loads(line)["training/global_step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def deterministic(records: dict, steps) -> dict:
    return {s: {k: v for k, v in records[s].items() if not k.startswith(NONDETERMINISTIC)} for s in steps}


# ----------------------------------------------------------------------------- no daemons needed
@pytest.mark.slow
@pytest.mark.parametrize(
    "golden,args",
    [
        ("qwen7b_klppo.sbatch", ["recipe=qwen7b_klppo"]),
        # 4 nodes, a site that asks for GPUs with --gres (the example profile) and one with --gpus-per-node
        ("qwen7b_klppo_4node_gres.sbatch", ["recipe=qwen7b_klppo_4node"]),
        (
            "qwen7b_klppo_4node_gpus_per_node.sbatch",
            ["recipe=qwen7b_klppo_4node", "launcher.gpu_request=gpus-per-node"],
        ),
    ],
)
def test_dry_run_sbatch_matches_the_golden_file(tmp_path, golden, args):
    out = run_launch(
        *args,
        "cluster=slurm",
        "launcher.cluster_profile=example-gpu",
        "--dry-run",
        f"trainer.default_local_dir={tmp_path}/run",
        env={"WANDB_API_KEY": "secret-key-123"},
    )
    assert out.returncode == 0, out.stderr
    script = out.stdout.split("# sbatch script (cluster=slurm)\n", 1)[1]
    script = script.replace(str(tmp_path), "<TMP>").replace(sys.executable, "<PYTHON>")
    assert "secret-key-123" not in out.stdout + out.stderr
    path = REPO / "tests" / "golden" / golden
    if os.environ.get("RLHF_HPC_UPDATE_GOLDEN"):
        path.write_text(script)
    assert script == path.read_text()


def test_unknown_profile_is_refused():
    out = launch_here(*TINY, "launcher.cluster_profile=locl", "--dry-run")
    assert out.returncode == 2
    assert (
        "launcher.cluster_profile: no profile 'locl' (did you mean 'local'?); available: example-gpu, local"
        in out.stderr
    )


# ----------------------------------------------------------------------------- real Slurm jobs
@pytest.mark.slow
def test_submitted_job_completes(slurm, tmp_path):
    run = tmp_path / "run"
    # (transformers' engine: vLLM under Slurm is the USR2 test's)
    steps = ["trainer.total_training_steps=4", "trainer.save_freq=2", "actor_rollout_ref.rollout.name=hf"]
    out = run_launch(*TINY, f"trainer.default_local_dir={run}", *steps)
    assert out.returncode == 0, out.stderr
    (job,) = job_ids(run)
    assert f"submitted job {job}: run directory {run}" in out.stdout
    assert wait_done(job) == "COMPLETED"
    assert raw_steps(run) == [1, 2, 3, 4]
    # the starting point (trainer.guard.initial_checkpoint), then every trainer.save_freq steps
    assert sorted(p.name for p in run.glob("global_step_*")) == ["global_step_0", "global_step_2", "global_step_4"]
    status = launch_here("status", str(run))
    assert status.stdout.strip() == f"{job}\tCOMPLETED"
    logs = run_launch("logs", str(run))
    assert "step 4/4 | score" in logs.stdout
    # the job's log has the layout (the submit's console is elsewhere) and names the libraries' logs
    assert logs.stdout.count("[rlhf-hpc] FSDP layout of actor, ref, critic") == 1
    # the job step has the CPUs the profile asks for (launcher.cpus_per_task=2, restated on srun)
    assert "torchrun with 2 ranks on 2 CPUs" in logs.stdout and "launcher.cpus_per_task asks for" not in logs.stdout
    assert f"warnings, by rank: {run}/logs/libraries.rank0.log, {run}/logs/libraries.rank1.log" in logs.stdout


@pytest.mark.slow
def test_preflight_through_slurm_checks_a_sharded_layout(slurm, tmp_path):
    """``launch.py preflight`` submitted like a run: the job's log has every check, the shard
    dimension's bandwidth among them (fsdp_size=2), and the hf engine's sleep/wake is skipped."""
    out = run_launch(
        "preflight",
        *TINY,
        f"trainer.default_local_dir={tmp_path}",
        "actor_rollout_ref.rollout.name=hf",
        *[f"{m}.fsdp_config.fsdp_size=2" for m in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model")],
    )
    assert out.returncode == 0, out.stderr
    run = tmp_path / "preflight"
    (job,) = job_ids(run)
    assert wait_done(job) == "COMPLETED"
    logs = run_launch("logs", str(run)).stdout
    assert "[rlhf-hpc] preflight passed: 7 checks" in logs, logs[-3000:]
    report = (run / "preflight.txt").read_text()
    assert "OK   bandwidth shard" in report and "all-gather" in report
    assert "SKIP sleep/wake" in report and "hf engine" in report
    assert "OK   generation" in report and "OK   actor micro-batch" in report


@pytest.mark.slow
def test_usr2_preemption_checkpoints_requeues_and_resumes_exactly(slurm, tmp_path):
    steps = 12
    common = [f"trainer.total_training_steps={steps}", "trainer.save_freq=100", "actor_rollout_ref.rollout.name=vllm"]
    run = tmp_path / "preempted"
    out = run_launch(*TINY, f"trainer.default_local_dir={run}", *common)
    assert out.returncode == 0, out.stderr
    (job,) = job_ids(run)
    deadline = time.time() + 300
    while time.time() < deadline and not ((run / "metrics.jsonl").is_file() and len(raw_steps(run)) >= 3):
        time.sleep(1)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    assert wait_done(job) == "COMPLETED"
    log = "".join(p.read_text() for p in (run / "slurm").glob(f"{job}_0_log.out"))
    assert "stopping after step" in log and "preempted (signal); checkpoint saved" in log
    assert "resumed from" in log
    # no step trained twice or skipped
    assert raw_steps(run) == list(range(1, steps + 1))
    # the same steps uninterrupted (here, same code path) give the same metrics
    whole = tmp_path / "whole"
    local = run_launch(
        "recipe=tiny_klppo",
        f"trainer.default_local_dir={whole}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "cluster=local",
        *common,
        timeout=600,
    )
    assert local.returncode == 0, local.stderr[-3000:]
    a = {r["training/global_step"]: r for r in read_metrics(whole)}
    b = {r["training/global_step"]: r for r in read_metrics(run)}
    assert deterministic(b, range(1, steps + 1)) == deterministic(a, range(1, steps + 1))


@pytest.mark.slow
def test_the_split_layout_runs_as_a_slurm_job_and_a_preemption_requeues_both_sides(slurm, tmp_path):
    """tiny_grpo_async (2 trainer ranks + 1 rollout rank) as one Slurm job: one torchrun of 3 ranks on
    the node; USR2 after step 2 stops both sides (the trainer saves, the rollout rank drops its rows
    ahead), Slurm requeues the job, and it resumes with each step trained once, one step stale again.
    The rollout rank's engine is transformers' generate: vLLM under Slurm is the preemption test's."""
    steps, run = 6, tmp_path / "run"
    out = run_launch(
        "recipe=tiny_grpo_async",
        "actor_rollout_ref.rollout.name=hf",
        "cluster=slurm",
        "launcher.cluster_profile=local",
        f"trainer.default_local_dir={run}",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=100",
        "trainer.inject_fault=slow@1",  # (1 s longer a step: the run is still going when the test signals it)
    )
    assert out.returncode == 0, out.stderr
    (job,) = job_ids(run)
    deadline = time.time() + 300
    while time.time() < deadline and not ((run / "metrics.jsonl").is_file() and len(raw_steps(run)) >= 2):
        time.sleep(1)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    assert wait_done(job) == "COMPLETED"
    log = "".join(p.read_text() for p in (run / "slurm").glob(f"{job}_0_log.out"))
    assert "torchrun with 3 ranks" in log and "(trainer side of the split layout)" in log
    assert "preempted (signal); checkpoint saved" in log and "resumed from" in log
    assert raw_steps(run) == list(range(1, steps + 1))
    metrics = read_metrics(run)
    assert max(m["rollout/staleness/max"] for m in metrics) == 1.0


@pytest.mark.slow
def test_time_limit_shorter_than_the_run_finishes_over_several_allocations(slurm, tmp_path):
    run = tmp_path / "run"
    # every step takes at least 1 s (trainer.inject_fault=slow@1): 40 steps cannot fit in the 40 s a
    # 1-minute allocation leaves before its 20 s margin, however fast the machine and its start-up are
    # (32 steps with a 15 s margin did fit once: 44 s with start-up); on a loaded machine an allocation
    # may fit only 3 steps after start-up, so requeues are allowed generously.
    # Slurm sends --signal up to its event loop's period early (sbatch(1): up to 60 s; here 26-30 s,
    # in every allocation): with USR2@20 each 1-minute allocation got USR2 10-14 s in, one step each,
    # and 15 requeues ended the run at step 18. USR2@5 comes after the trainer's own stop (15 s margin)
    # or at most ~30 s early, 25 s in.
    out = run_launch(
        *TINY,
        f"trainer.default_local_dir={run}",
        "trainer.total_training_steps=40",
        "trainer.save_freq=100",
        "launcher.time_min=1",
        "launcher.signal_lead_s=5",
        "launcher.time_margin_s=20",
        "launcher.max_requeues=20",
        "actor_rollout_ref.rollout.name=hf",
        "trainer.inject_fault=slow@1",
    )
    assert out.returncode == 0, out.stderr
    (job,) = job_ids(run)
    assert wait_done(job, timeout=900) == "COMPLETED"
    assert raw_steps(run) == list(range(1, 41))
    log = "".join(p.read_text() for p in (run / "slurm").glob(f"{job}_0_log.out"))
    assert log.count("resumed from") >= 1  # at least two allocations


@pytest.mark.slow
def test_max_requeues_bounds_the_preemption_loop(slurm, tmp_path):
    # two preemptions, one requeue allowed: the second stop saves and ends the job, not requeued
    run = tmp_path / "run"
    out = run_launch(
        *TINY,
        f"trainer.default_local_dir={run}",
        "trainer.total_training_steps=40",
        "trainer.save_freq=100",
        "launcher.max_requeues=1",
        "actor_rollout_ref.rollout.name=hf",
    )
    assert out.returncode == 0, out.stderr
    (job,) = job_ids(run)
    for signalled in (1, 2):
        deadline = time.time() + 300
        while time.time() < deadline and not (
            (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 2 * signalled + 1
        ):
            time.sleep(1)
        if signalled == 2:  # the requeued allocation must have resumed before the second signal
            while time.time() < deadline and "resumed from" not in "".join(
                p.read_text() for p in (run / "slurm").glob(f"{job}_0_log.out")
            ):
                time.sleep(1)
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
        time.sleep(5)
    wait_done(job)
    log = "".join(p.read_text() for p in (run / "slurm").glob(f"{job}_0_log.out"))
    assert log.count("preempted (signal); checkpoint saved") == 2
    assert "not requeuing: launcher.max_requeues=1 reached" in log
    steps = raw_steps(run)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 40  # stopped early, no step twice
    assert (run / "latest_checkpointed_iteration.txt").read_text() == str(steps[-1])  # the stop was saved
    assert subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip() == ""


@pytest.mark.slow
@pytest.mark.parametrize(
    "override,message",
    [
        (
            "launcher.partition=gpu-h100",
            "launcher.partition: 'gpu-h100' is not a partition of this cluster (sinfo lists: debug)",
        ),
        ("launcher.cpus_per_task=64", "Slurm rejects the resource request"),
    ],
)
def test_bad_requests_are_refused_before_submission(slurm, tmp_path, override, message):
    run = tmp_path / "run"
    before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    out = run_launch(*TINY, f"trainer.default_local_dir={run}", override)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert message in out.stderr
    assert not run.exists()
    assert subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout == before


def test_the_steps_restate_the_jobs_cpus(tmp_path):
    """Both job scripts give srun the job's --cpus-per-task (Slurm 22.05-23.11 steps do not inherit it)."""
    out = launch_here(*TINY, "--dry-run", f"trainer.default_local_dir={tmp_path}/run")
    assert out.returncode == 0, out.stderr
    (srun,) = [line for line in out.stdout.splitlines() if line.startswith("srun ")]
    assert "--cpus-per-task=2" in srun.split()  # slurm/clusters/local.yaml: cpus_per_task 2
    plain = (REPO / "slurm" / "klppo.sbatch").read_text()
    (srun,) = [line for line in plain.splitlines() if line.startswith("srun ")]
    assert '${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"}' in srun


def test_a_step_with_fewer_cpus_than_asked_is_said():
    from rlhf_hpc.planning.hardware import step_cpu_warning

    said = step_cpu_warning(64, 1, None)
    assert (
        said.startswith(
            "this node's job step can use 1 of the 64 CPUs launcher.cpus_per_task asks for (SLURM_CPUS_PER_TASK=unset)"
        )
        and "--cpus-per-task" in said
    )
    assert step_cpu_warning(64, 64, "64") is None and step_cpu_warning(None, 1, None) is None


@pytest.mark.slow
def test_plain_sbatch_runs_the_same_job(slurm, tmp_path):
    run = tmp_path / "run"
    out = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--cpus-per-task=2",
            f"--output={tmp_path}/job-%j.out",
            "--export=ALL,RLHF_HPC_PYTHON=" + sys.executable,
            "slurm/klppo.sbatch",
            "recipe=tiny_klppo",
            f"trainer.default_local_dir={run}",
            "trainer.total_training_steps=2",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            "actor_rollout_ref.rollout.name=hf",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    job = out.stdout.strip().split(";")[0]
    assert wait_done(job) == "COMPLETED", (tmp_path / f"job-{job}.out").read_text()[-3000:]
    assert raw_steps(run) == [1, 2]
    log = (tmp_path / f"job-{job}.out").read_text()
    assert "step 2/2 | score" in log
    assert "torchrun with 2 ranks on 2 CPUs" in log  # sbatch --cpus-per-task=2, restated on its srun
