"""Multi-node jobs against a real multi-node Slurm on this machine (``slurm/dev-cluster.sh up
--nodes 4``; started by .ci/run): every node is a slurmd in its own network and UTS namespace, so
Slurm, torchrun and gloo see separate hosts (node1, node2, ...).

On it: a 2-node job through launch.py and through plain sbatch (ranks on two hosts, rendezvous at
the first node, metrics equal to a 1-node 2-rank run), USR2 preemption across nodes, a node dying
mid-run, a sweep as one array job spread over nodes, two jobs sharing a node, and the 4-node recipe
with a tiny model for two steps.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_hpc.observability.tracking import read_metrics
from tests.conftest import REPO, require, run_launch, seed_args
from tests.test_slurm import TINY, deterministic, job_ids, raw_steps, slurm_up, state, wait_done

# one mesh for every layout: shard over all ranks. Left at its default (fsdp_size = ranks per node),
# 1 node x 2 ranks would shard over both and 2 nodes x 1 rank would replicate (HSDP): other
# collectives, other float32 rounding
SAME_MESH = [
    f"{m}.fsdp_config.fsdp_size=-1" for m in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model")
]
TWO_NODES = [*TINY, "trainer.nnodes=2", "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf", *SAME_MESH]
# each rank one OpenMP thread whatever the rank count on its node: equal arithmetic in every layout
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
STEPS = 12
_two_node: dict = {}


def cluster_nodes() -> list[str]:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, timeout=30)
    return sorted(set(out.stdout.split()))


def need_nodes(n: int) -> list[str]:
    require("a running Slurm", slurm_up(), "start it with: bash slurm/dev-cluster.sh up --nodes 4")
    nodes = cluster_nodes()
    require(
        f"a Slurm cluster of {n} nodes",
        len(nodes) >= n,
        f"it has {len(nodes)}; start it with: bash slurm/dev-cluster.sh up --nodes 4",
    )
    return nodes


def job_logs(run: Path, job: str) -> dict[int, str]:
    """submitit's per-node logs (task t = node t), stdout and stderr together."""
    logs: dict[int, str] = {}
    for p in sorted((run / "slurm").glob(f"{job}_*_log.*")):
        node = int(p.name.split("_")[1])
        logs[node] = logs.get(node, "") + p.read_text()
    return logs


def hosts_by_rank(text: str) -> list[list[str]]:
    return [m.split(",") for m in re.findall(r"process group up: \d+ ranks, .*hosts by rank: (\S+)", text)]


def sacct_fields(job: str, fields: str) -> list[str]:
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", fields], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1].split("|")


def start_one_node_run(run: Path) -> subprocess.Popen:
    """The same recipe and steps as 1 node x 2 ranks (cluster=local), in the background."""
    return subprocess.Popen(
        [
            sys.executable,
            str(REPO / "launch.py"),
            "recipe=tiny_klppo",
            "cluster=local",
            f"trainer.default_local_dir={run}",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.rollout.name=hf",
            f"trainer.total_training_steps={STEPS}",
            "trainer.save_freq=100",
            *SAME_MESH,
            *seed_args(),
        ],
        cwd=REPO,
        env=dict(os.environ, **ONE_THREAD),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def two_node_run(tmp_path_factory) -> tuple[Path, str]:
    """An uninterrupted 2-node x 1-rank job (launch.py, submitit): run once, shared by the tests."""
    if not _two_node:
        run = tmp_path_factory.mktemp("two_node") / "run"
        out = run_launch(
            *TWO_NODES,
            f"trainer.default_local_dir={run}",
            f"trainer.total_training_steps={STEPS}",
            "trainer.save_freq=100",
            env=ONE_THREAD,
        )
        assert out.returncode == 0, out.stderr
        (job,) = job_ids(run)
        assert wait_done(job) == "COMPLETED", job_logs(run, job)
        _two_node.update(run=run, job=job)
    return _two_node["run"], _two_node["job"]


def differences(a: dict, b: dict) -> list:
    """(step, key, a, b) wherever two runs' metrics differ, for the failure message."""
    return [(s, k, a[s].get(k), b[s].get(k)) for s in a for k in set(a[s]) | set(b[s]) if a[s].get(k) != b[s].get(k)]


def wait_for_steps(run: Path, n: int, job: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (run / "metrics.jsonl").is_file() and len(raw_steps(run)) >= n:
            return
        time.sleep(0.5)
    raise AssertionError(f"job {job}: fewer than {n} steps after {timeout} s (state {state(job)})")


# --------------------------------------------------------------------------------- 2-node jobs
@pytest.mark.slow
def test_two_node_job_spans_two_hosts_and_equals_a_one_node_run(tmp_path, tmp_path_factory):
    need_nodes(2)
    one_node = start_one_node_run(tmp_path / "one_node")
    run, job = two_node_run(tmp_path_factory)
    logs = job_logs(run, job)
    assert sorted(logs) == [0, 1]
    # one torchrun per node, each on its own host, both meeting at the first node (not localhost)
    first, second = subprocess.run(
        ["scontrol", "show", "hostnames", sacct_fields(job, "NodeList")[0]], capture_output=True, text=True
    ).stdout.split()
    port = 29500 + int(job) % 16000
    assert f"node 0/2 on {first}: torchrun with 1 ranks on 2 CPUs, rendezvous {first}:{port} (id {job}" in logs[0]
    assert f"node 1/2 on {second}: torchrun with 1 ranks on 2 CPUs, rendezvous {first}:{port} (id {job}" in logs[1]
    (group,) = hosts_by_rank(logs[0] + logs[1])
    assert sorted(group) == [first, second]  # the process group spans both hosts
    assert raw_steps(run) == list(range(1, STEPS + 1))
    logs_cmd = run_launch("logs", str(run))
    assert f"node 1/2 on {second}" in logs_cmd.stdout and f"step {STEPS}/{STEPS} | score" in logs_cmd.stdout
    # the same world and mesh as 2 ranks on one node: the same training, bit for bit on CPU
    assert one_node.wait(timeout=600) == 0, one_node.stdout.read()[-3000:]
    want = {r["training/global_step"]: r for r in read_metrics(tmp_path / "one_node")}
    got = {r["training/global_step"]: r for r in read_metrics(run)}
    steps = range(1, STEPS + 1)
    assert deterministic(got, steps) == deterministic(want, steps), differences(
        deterministic(got, steps), deterministic(want, steps)
    )[:5]


@pytest.mark.slow
def test_plain_sbatch_two_nodes(tmp_path):
    need_nodes(2)
    run = tmp_path / "run"
    out = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=2",
            "--cpus-per-task=2",
            f"--output={tmp_path}/job-%j.out",
            "--export=ALL,OMP_NUM_THREADS=1,RLHF_HPC_PYTHON=" + sys.executable,
            "slurm/klppo.sbatch",
            "recipe=tiny_klppo",
            "trainer.nnodes=2",
            "trainer.n_gpus_per_node=1",
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
    log_path = tmp_path / f"job-{job}.out"
    assert wait_done(job) == "COMPLETED", log_path.read_text()[-3000:]
    log = log_path.read_text()
    assert raw_steps(run) == [1, 2]
    assert "step 2/2 | score" in log
    (group,) = hosts_by_rank(log)
    assert len(set(group)) == 2, group
    assert len(re.findall(r"node [01]/2 on node\d+: torchrun", log)) == 2


# --------------------------------------------------------------------------------- failures
@pytest.mark.slow
def test_usr2_preemption_stops_both_nodes_at_one_step_and_resumes(tmp_path, tmp_path_factory):
    need_nodes(2)
    run = tmp_path / "run"
    out = run_launch(
        *TWO_NODES,
        f"trainer.default_local_dir={run}",
        f"trainer.total_training_steps={STEPS}",
        "trainer.save_freq=100",
        env=ONE_THREAD,
    )
    assert out.returncode == 0, out.stderr
    (job,) = job_ids(run)
    wait_for_steps(run, 2, job)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    assert wait_done(job) == "COMPLETED", job_logs(run, job)
    text = "\n".join(job_logs(run, job).values())
    (stop,) = [int(s) for s in re.findall(r"stopping after step (\d+): preempted \(signal\); checkpoint saved", text)]
    assert 2 <= stop < STEPS
    assert f"resumed from {run}/global_step_{stop} (step {stop})" in text
    # the starting point, one checkpoint at the stop, written by both ranks (one on each node), and the final one
    assert {p.name for p in run.glob("global_step_*")} == {
        "global_step_0",
        f"global_step_{stop}",
        f"global_step_{STEPS}",
    }
    assert sorted(p.name for p in (run / f"global_step_{stop}" / "rng").iterdir()) == ["rank_0.pt", "rank_1.pt"]
    assert len(hosts_by_rank(text)) == 2  # two allocations, each a 2-host group
    assert raw_steps(run) == list(range(1, STEPS + 1))  # every step logged exactly once
    # bit for bit the uninterrupted 2-node run
    whole, _ = two_node_run(tmp_path_factory)
    want = {r["training/global_step"]: r for r in read_metrics(whole)}
    got = {r["training/global_step"]: r for r in read_metrics(run)}
    assert deterministic(got, range(1, STEPS + 1)) == deterministic(want, range(1, STEPS + 1))


@pytest.mark.slow
def test_a_node_dies_and_the_job_resumes_from_the_last_checkpoint(tmp_path):
    nodes = need_nodes(2)
    run = tmp_path / "run"
    out = run_launch(
        *TWO_NODES,
        f"trainer.default_local_dir={run}",
        "trainer.total_training_steps=10",
        "trainer.save_freq=3",
        env=ONE_THREAD,
    )
    assert out.returncode == 0, out.stderr
    (job,) = job_ids(run)
    wait_for_steps(run, 4, job)
    before = (run / "metrics.jsonl").read_text()
    victim = subprocess.run(
        ["scontrol", "show", "hostnames", sacct_fields(job, "NodeList")[0]], capture_output=True, text=True
    ).stdout.split()[1]
    subprocess.run(["bash", "slurm/dev-cluster.sh", "fail-node", victim], cwd=REPO, check=True, timeout=60)
    # Slurm notices (SlurmdTimeout) and requeues the job (--requeue); with no spare node it waits for
    # the failed one, which the "admin" brings back
    deadline = time.time() + 300
    while time.time() < deadline:
        restarts = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
        if "Restarts=1" in restarts:
            break
        time.sleep(2)
    assert "Restarts=1" in restarts, restarts
    up = subprocess.run(
        ["bash", "slurm/dev-cluster.sh", "up", "--nodes", str(len(nodes))],
        cwd=REPO,
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert up.returncode == 0, up.stdout + up.stderr
    assert wait_done(job) == "COMPLETED", job_logs(run, job)
    text = "\n".join(job_logs(run, job).values())
    resumed = [int(s) for s in re.findall(r"resumed from \S+ \(step (\d+)\)", text)]
    assert len(resumed) == 1 and resumed[0] >= 3 and resumed[0] % 3 == 0, text[-3000:]
    # nothing written before the failure is lost: its log lines and checkpoints are still there
    assert (run / "metrics.jsonl").read_text().startswith(before)
    assert {f"global_step_{s}" for s in range(3, resumed[0] + 1, 3)} <= {p.name for p in run.glob("global_step_*")}
    assert [r["training/global_step"] for r in read_metrics(run)] == list(range(1, 11))


# --------------------------------------------------------------------------------- sharing nodes
@pytest.mark.slow
def test_two_jobs_on_one_node_do_not_collide(tmp_path):
    """Two one-CPU jobs pinned to one node run at once, each with its own rendezvous. Both are
    submitted held and released together, so they overlap however long the second submission
    takes on a loaded machine (submitted one after the other, a 3-step job once ended before the
    next was queued)."""
    nodes = need_nodes(2)
    runs, jobs = [tmp_path / "a", tmp_path / "b"], []
    for run in runs:  # one CPU each, both pinned to the same node
        out = run_launch(
            *TINY,
            f"trainer.default_local_dir={run}",
            "trainer.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.name=hf",
            "trainer.total_training_steps=3",
            "launcher.cpus_per_task=1",
            f"launcher.additional_sbatch=[--nodelist={nodes[0]},--hold]",
            env=ONE_THREAD,
        )
        assert out.returncode == 0, out.stderr
        jobs += job_ids(run)
    subprocess.run(["scontrol", "release", *jobs], check=True, timeout=30)
    for job, run in zip(jobs, runs):
        assert wait_done(job) == "COMPLETED", job_logs(run, job)
        assert raw_steps(run) == [1, 2, 3]
    (a_start, a_end, a_node), (b_start, b_end, b_node) = (sacct_fields(j, "Start,End,NodeList") for j in jobs)
    assert a_node == b_node == nodes[0]
    assert a_start < b_end and b_start < a_end, "the two jobs did not overlap"
    ports = {re.search(r"rendezvous \S+:(\d+) \(id (\d+)", job_logs(r, j)[0]).groups() for j, r in zip(jobs, runs)}
    assert len({p for p, _ in ports}) == 2 and len({i for _, i in ports}) == 2


@pytest.mark.slow
def test_sweep_is_one_array_job_spread_over_the_nodes(tmp_path):
    need_nodes(2)
    out = run_launch(
        *TINY,
        f"trainer.default_local_dir={tmp_path}/" + "${trainer.experiment_name}",
        "trainer.total_training_steps=2",
        "actor_rollout_ref.rollout.name=hf",
        "sweep.algorithm.kl_ctrl.kl_coef=[0.001,0.01]",
        env=ONE_THREAD,
    )
    assert out.returncode == 0, out.stderr
    runs = [tmp_path / "tiny_klppo_kl_coef=0.001", tmp_path / "tiny_klppo_kl_coef=0.01"]
    ids = [job_ids(r)[0] for r in runs]
    assert ids[0].split("_")[0] == ids[1].split("_")[0] and [i.split("_")[1] for i in ids] == ["0", "1"]
    for job in ids:
        assert wait_done(job) == "COMPLETED"
    for run in runs:
        assert raw_steps(run) == [1, 2]
    from rlhf_hpc.recipe.load import load_resolved

    assert [load_resolved(r / "config.yaml").algorithm.kl_ctrl.kl_coef for r in runs] == [0.001, 0.01]
    # a whole node each (cpus_per_task=2 of 2): both elements ran at once, on different nodes
    (a_start, a_end, a_node), (b_start, b_end, b_node) = (sacct_fields(j, "Start,End,NodeList") for j in ids)
    assert a_node != b_node and a_start < b_end and b_start < a_end


# --------------------------------------------------------------------------------- 4 nodes
TINY_4NODE = [
    "recipe=qwen7b_klppo_4node",
    "cluster=slurm",
    "launcher.cluster_profile=local",
    "trainer.device=cpu",
    "trainer.n_gpus_per_node=1",
    "trainer.logger=[console]",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
    "trainer.total_training_steps=2",
    "trainer.save_freq=-1",
    "data.train_files=synthetic://copy",
    "data.val_files=synthetic://copy?size=64",
    "data.train_batch_size=8",
    "data.max_prompt_length=32",
    "data.max_response_length=8",
    "actor_rollout_ref.model.path=tiny://qwen2?vocab_size=64",
    "actor_rollout_ref.model.enable_gradient_checkpointing=false",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.ppo_epochs=1",
    "actor_rollout_ref.actor.fsdp_config.param_offload=false",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=false",
    "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=float32",
    "actor_rollout_ref.ref.fsdp_config.param_offload=false",
    "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=float32",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.name=hf",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.dtype=float32",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "critic.ppo_micro_batch_size_per_gpu=2",
    "critic.model.fsdp_config.mixed_precision.param_dtype=float32",
]


@pytest.mark.slow
def test_four_node_recipe_runs_two_steps_on_four_nodes(tmp_path):
    need_nodes(4)
    run = tmp_path / "run"
    out = run_launch(*TINY_4NODE, f"trainer.default_local_dir={run}", env=ONE_THREAD)
    assert out.returncode == 0, out.stderr
    (job,) = job_ids(run)
    assert wait_done(job, timeout=900) == "COMPLETED", job_logs(run, job)
    logs = job_logs(run, job)
    assert sorted(logs) == [0, 1, 2, 3]
    (group,) = hosts_by_rank("\n".join(logs.values()))
    assert len(set(group)) == 4, group
    assert raw_steps(run) == [1, 2]
