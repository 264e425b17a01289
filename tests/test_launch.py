"""``launch.py`` as a user runs it: help, dry run, user errors, a local torchrun launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from rlhf_hpc.distributed.host_allocator import malloc_tunables
from rlhf_hpc.recipe.load import load_resolved
from tests.conftest import REPO, launch_here, run_launch


def test_help_lists_recipes_and_main_keys():
    out = launch_here("--help")
    assert out.returncode == 0, out.stderr
    for name in ("tiny_klppo", "qwen7b_klppo", "qwen7b_klppo_4node", "qwen05b_klppo"):
        assert f"\n  {name} " in out.stdout
    assert "actor_rollout_ref.actor.kl_loss_type" in out.stdout and "'low_var_kl'" in out.stdout


def test_dry_run_prints_resolved_config_and_command_and_runs_nothing(tmp_path):
    out = launch_here("recipe=qwen7b_klppo", "--dry-run", f"trainer.default_local_dir={tmp_path}/run", "cluster=local")
    assert out.returncode == 0, out.stderr
    config_text, _, command = out.stdout.partition("# command (cluster=local)\n")
    cfg = yaml.safe_load(config_text)
    assert cfg["actor_rollout_ref"]["actor"]["kl_loss_type"] == "low_var_kl"
    assert cfg["actor_rollout_ref"]["rollout"]["gpu_memory_utilization"] == 0.6
    assert cfg["trainer"]["default_local_dir"] == f"{tmp_path}/run"
    assert "-m torch.distributed.run --standalone --nnodes=1 --nproc-per-node=8" in command
    assert command.strip().endswith(f"-m rlhf_hpc.worker {tmp_path}/run/config.yaml")
    # the data lives on the cluster, not here: reported, not fatal, in a dry run
    assert "warning: data.train_files: '~/data/gsm8k/train.parquet' does not exist on this machine" in out.stderr
    assert not (tmp_path / "run").exists()


def test_user_error_exits_non_zero_without_traceback():
    out = launch_here("recipe=tiny_klppo", "actor_rollout_ref.actor.lr=1e-6", "--dry-run")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert (
        "error: invalid configuration: unknown key 'actor_rollout_ref.actor.lr' in section "
        "'actor_rollout_ref.actor'; did you mean 'actor_rollout_ref.actor.optim.lr'?"
    ) in out.stderr


@pytest.mark.slow
def test_no_recipe_means_the_defaults_and_bad_arguments():
    # as verl: its defaults (ppo_trainer.yaml's, which are this project's) are enough to start from
    out = launch_here("--dry-run", "cluster=local")
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout.partition("# command (cluster=local)\n")[0])
    assert cfg["trainer"]["recipe"] is None and cfg["data"]["train_batch_size"] == 1024
    assert cfg["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] == 256
    out = run_launch("recipe=tiny_klppo", "lr", fresh=True)  # the script itself, as typed
    assert out.returncode == 2 and "argument 'lr' is not of the form key.path=value" in out.stderr
    out = run_launch("recipe=tiny_klppo", "--dryrun")
    assert out.returncode == 2 and "unknown option '--dryrun'" in out.stderr


@pytest.mark.slow
def test_real_launch_checks_files_first(tmp_path):
    out = run_launch(
        "recipe=tiny_klppo", f"data.train_files={tmp_path}/missing.parquet", f"trainer.default_local_dir={tmp_path}/run"
    )
    assert out.returncode == 2
    assert f"data.train_files: '{tmp_path}/missing.parquet' does not exist" in out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_slurm_without_sbatch_is_a_clear_error(tmp_path):
    out = run_launch(
        "recipe=tiny_klppo", "cluster=slurm", f"trainer.default_local_dir={tmp_path}/run", env={"PATH": str(tmp_path)}
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "launcher.cluster=slurm but sbatch is not on PATH" in out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_auto_cluster_picks_local_without_sbatch(tmp_path):
    out = run_launch("recipe=tiny_klppo", "cluster=auto", "--dry-run", env={"PATH": str(tmp_path)})  # no sbatch
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout.partition("# command")[0])["launcher"]["cluster"] == "local"


@pytest.mark.slow
def test_auto_cluster_picks_slurm_where_sbatch_exists(tmp_path):
    fake = tmp_path / "sbatch"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    out = run_launch("recipe=tiny_klppo", "cluster=auto", "--dry-run", env={"PATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "# sbatch script (cluster=slurm)" in out.stdout
    node = out.stdout.split("# then on each node: ")[1].splitlines()[0].split()
    assert node[:4] == [sys.executable, "-m", "torch.distributed.run", "--nnodes=1"], node  # the job's own Python
    # in a container, the container's Python: the host venv's would run there with the host's packages
    out = run_launch(
        "recipe=tiny_klppo",
        "cluster=slurm",
        "--dry-run",
        "launcher.container=apptainer exec --nv --bind /project /images/rlhf-hpc-gpu.sif",
        env={"PATH": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr
    node = out.stdout.split("# then on each node: ")[1].splitlines()[0].split()
    assert node[:8] == ["apptainer", "exec", "--nv", "--bind", "/project", "/images/rlhf-hpc-gpu.sif", "python", "-m"]
    assert sys.executable not in node and node[-2:] == ["rlhf_hpc.worker", node[-1]]


@pytest.mark.slow
def test_local_launch_brings_up_a_gloo_group_of_the_configured_size(tmp_path):
    """The README's demo command path: torchrun with 2 CPU ranks, resolved config in the run dir
    (``launch.py`` in a new interpreter, as a user types it)."""
    run_dir = tmp_path / "run"
    out = run_launch(
        "recipe=tiny_klppo",
        f"trainer.default_local_dir={run_dir}",
        "trainer.total_training_steps=2",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "actor_rollout_ref.rollout.name=hf",
        timeout=300,
        fresh=True,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "process group up: 2 ranks, backend gloo, device cpu" in out.stdout
    assert "step 2/2 | score" in out.stdout
    # the tiny models are replicated: their gradients are averaged through shared memory on this machine
    assert "actor: gradients averaged across the 2 replicas through shared memory" in out.stdout
    assert "critic: gradients averaged across the 2 replicas through shared memory" in out.stdout
    expected = malloc_tunables(os.environ)[1]  # the settings, or why the user's own stay
    assert f"host memory: {expected}" in out.stdout
    cfg = load_resolved(run_dir / "config.yaml")
    assert cfg.trainer.n_gpus_per_node == 2 and cfg.launcher.cluster == "local"
    assert not list(run_dir.glob("global_step_*"))  # save_freq=-1: no checkpoint


@pytest.mark.slow
def test_worker_refuses_a_group_of_the_wrong_size(tmp_path):
    out = launch_here("recipe=tiny_klppo", f"trainer.default_local_dir={tmp_path}", "--dry-run")
    assert out.returncode == 0
    (tmp_path / "config.yaml").write_text(out.stdout.partition("# command")[0].partition("\n")[2])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=1",
            "-m",
            "rlhf_hpc.worker",
            str(tmp_path / "config.yaml"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode != 0
    assert "torchrun started 1 ranks but trainer.nnodes x trainer.n_gpus_per_node = 2" in proc.stderr


@pytest.mark.slow
def test_user_error_found_by_the_workers_is_one_line_for_the_job(tmp_path):
    # the launching machine checks columns; only the workers (with the tokenizer) see a prompt's length
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "synthetic/copy",
            "prompt": [{"role": "user", "content": "copy: " + "a" * n}],
            "reward_model": {"ground_truth": "a"},
        }
        for n in (3, 4, 60, 5)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    out = run_launch(
        "recipe=tiny_klppo",
        f"data.train_files={tmp_path}/train.parquet",
        "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.name=hf",
        f"trainer.default_local_dir={tmp_path}/run",
        timeout=300,
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert lines == [
        f"error: {tmp_path}/train.parquet, row 2, column 'prompt': the prompt is 85 tokens, more than "
        f"data.max_prompt_length=32 (set data.truncation=left|right or data.filter_overlong_prompts=true)"
    ]
    assert "Traceback" not in out.stderr and "ChildFailedError" not in out.stderr


FORKED_TORCHRUN = """
import json, os, signal, sys, time
from rlhf_hpc.launch.rank_group import ForkedTorchrun, start_torchrun

out, script = sys.argv[1], sys.argv[2]
launcher_file = open(out + ".launcher", "w")  # a file of the launcher's, open while torchrun starts
found = {}
for code in (0, 3):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           script, out + f".rank{code}", str(code)]
    proc = start_torchrun(cmd, dict(os.environ, RANK_EXIT=str(code)))
    found[f"forked{code}"] = isinstance(proc, ForkedTorchrun)
    while not os.path.exists(out + f".rank{code}") and proc.poll() is None:
        time.sleep(0.05)
    fds = [os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd")]
    status = dict(line.split(":\\t", 1) for line in open(f"/proc/{proc.pid}/status").read().splitlines())
    found[f"session{code}"] = os.getsid(proc.pid) == proc.pid
    found[f"launcher_file{code}"] = any(f.endswith(".launcher") for f in fds)
    found[f"usr2_ignored{code}"] = bool(int(status["SigIgn"], 16) >> (signal.SIGUSR2 - 1) & 1)
    found[f"code{code}"] = proc.wait()
print(json.dumps(found))
"""


@pytest.mark.slow
def test_torchrun_on_the_launchers_interpreter_is_forked_and_set_up_as_the_command_would_be(tmp_path):
    """torchrun started by the launcher (``rank_group.start_torchrun``) on this interpreter is a fork
    of it, with the command's set-up: its own session, SIGUSR2 ignored, none of the launcher's files;
    a rank's failure is torchrun's exit code 1, as the command's.
    (Run in a subprocess of its own: the test worker's standard output is pytest-xdist's channel.)"""
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys, time\n"
        "open(sys.argv[1], 'w').write(os.environ['RANK'])\n"
        "time.sleep(1)\n"
        "sys.exit(int(sys.argv[2]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", FORKED_TORCHRUN, str(tmp_path / "out"), str(script)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    for code, exit_code in ((0, 0), (3, 1)):  # torchrun exits 1 when a rank fails
        assert found[f"forked{code}"] and found[f"session{code}"] and found[f"usr2_ignored{code}"], found
        assert not found[f"launcher_file{code}"], found
        assert found[f"code{code}"] == exit_code, found
        assert (tmp_path / f"out.rank{code}").read_text() == "0"
