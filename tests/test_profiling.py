"""Step profiling and MLflow on a real tiny run (``tiny_klppo``, 2 gloo ranks, the hf engine).

One module-scoped pair of launches: 3 steps with step 2 traced and MLflow on (checkpoints at
steps 2 and 3), then the same run directory with 4 steps, which resumes from step 3. Checked on
it: the traces, the communication meter against the profiler's record of the same step, the
per-step ``perf/comm_fraction`` split, the MLflow run read back with MLflow's client (one run across
the resume, parameters, tags, the config artifact, metric histories equal to ``metrics.jsonl``),
and ``launch.py compare`` on the MLflow copy. The rest (metric-name mapping, the hint rule, config
checks, the ``launcher.nsys`` sbatch golden file) needs no launch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient  # in the test extras (setup.cfg)

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.distributed.comm import GROUPS, collective
from rlhf_hpc.observability.compare import compare, load_run, series
from rlhf_hpc.observability.perf import Timer
from rlhf_hpc.observability.profiling import HINT_STEPS, CommHint, StepProfiler
from rlhf_hpc.observability.tracking import Tracker, config_hash, mlflow_metric_name, mlflow_tracking_uri, read_metrics
from rlhf_hpc.recipe.load import load_config, load_resolved
from tests.conftest import REPO, launch_here, run_launch

NSYS_GOLDEN = REPO / "tests" / "golden" / "qwen7b_klppo_nsys.sbatch"
TRACED_STEP = 2
# The meter's time encloses what the profiler records of each collective (blocking calls), plus the
# hand-off to gloo's worker thread and back, which grows with CPU load (measured here: 0.01-0.6 ms
# per collective). Tolerance: 0.9 x profiler <= meter <= 1.1 x profiler + 1 ms per collective.
COMM_REL_TOLERANCE = 0.1
HANDOFF_S = 1e-3
COLLECTIVE_OPS = ("c10d::", "_c10d_functional::")
NOT_COLLECTIVES = ("_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd")


def launch(run: Path, steps: int):
    out = run_launch(
        "recipe=tiny_klppo",
        f"trainer.default_local_dir={run}",
        "actor_rollout_ref.rollout.name=hf",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=2",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.logger=[console,mlflow]",
        f"trainer.profile_steps=[{TRACED_STEP}]",
        # sharded, so FSDP's all-gathers are there to trace (the tiny model alone would be
        # replicated: rlhf_hpc.planning.layout)
        *[f"{m}.fsdp_config.fsdp_size=2" for m in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model")],
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)  # the default: a file store in the run directory
        root = tmp_path_factory.mktemp("profiled")
        run = root / "run"
        first = launch(run, 3)
        second = launch(run, 4)
        yield run, first.stdout, second.stdout


# ------------------------------------------------------------------------------ traces
def _union_s(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, None
    start = None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    return (total + (end - start if end is not None else 0.0)) / 1e6


def profiler_comm(trace: dict) -> tuple[int, float]:
    """(collective ops, seconds in collectives) as the profiler recorded them: top-level
    ``c10d::``/``_c10d_functional::`` ops on the rank's threads (a functional all-reduce runs a
    ``c10d::allreduce_`` inside it: counted once), and the union of those ops with gloo's transfers
    on its worker threads (``gloo:*``)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    ops = [e for e in events if e["name"].startswith(COLLECTIVE_OPS) and e["name"] not in NOT_COLLECTIVES]
    top = [
        e
        for e in ops
        if not any(
            o is not e and o["tid"] == e["tid"] and o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"]
            for o in ops
        )
    ]
    gloo = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("gloo:")]
    return len(top), _union_s(gloo + [(e["ts"], e["ts"] + e["dur"]) for e in ops])


@pytest.mark.slow
def test_chosen_step_is_traced_on_every_rank_with_the_loop_phases(run):
    run_dir, _, _ = run
    traces = run_dir / "profile"
    assert sorted(p.name for p in traces.iterdir()) == [f"step{TRACED_STEP}"]  # that step only
    for rank in (0, 1):
        trace = json.loads((traces / f"step{TRACED_STEP}" / f"rank{rank}.pt.trace.json").read_text())
        names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
        assert {
            "phase/update_weights",
            "phase/gen",
            "phase/old_log_prob",
            "phase/update_critic",
            "phase/update_actor",
        } <= names
        assert any(n.startswith("FSDP::all_gather") for n in names) and "gloo:all_gather" in names


@pytest.mark.slow
def test_comm_meter_agrees_with_the_profiler_on_the_traced_step(run):
    run_dir, _, _ = run
    for rank in (0, 1):
        d = run_dir / "profile" / f"step{TRACED_STEP}"
        meter = json.loads((d / f"rank{rank}.comm.json").read_text())
        calls, seconds = profiler_comm(json.loads((d / f"rank{rank}.pt.trace.json").read_text()))
        print(
            f"rank {rank}: meter {meter['calls']} collectives {meter['comm_s']:.3f} s, profiler {calls} "
            f"collectives {seconds:.3f} s, step {meter['step_s']:.3f} s"
        )
        assert meter["calls"] == calls  # every collective of the step went through the meter
        assert (1 - COMM_REL_TOLERANCE) * seconds <= meter["comm_s"]
        assert meter["comm_s"] <= (1 + COMM_REL_TOLERANCE) * seconds + HANDOFF_S * calls
        assert meter["by_phase_s"]["train"] > 0 and meter["by_phase_s"]["weight_sync"] > 0


@pytest.mark.slow
def test_every_step_logs_the_comm_fraction_and_its_split(run):
    run_dir, _, _ = run
    records = read_metrics(run_dir)
    assert [r["training/global_step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        split = sum(r[f"perf/comm_fraction_{g}"] for g in GROUPS)
        assert 0 < r["perf/comm_fraction"] < 1 and split == pytest.approx(r["perf/comm_fraction"], rel=1e-9)
        assert r["perf/comm_fraction"] == pytest.approx(r["timing_s/comm"] / r["timing_s/step"], rel=1e-9)
        assert r["perf/comm_fraction_train"] > 0 and r["perf/comm_fraction_weight_sync"] > 0
    meter = json.loads((run_dir / "profile" / f"step{TRACED_STEP}" / "rank0.comm.json").read_text())
    assert records[TRACED_STEP - 1]["timing_s/comm"] == pytest.approx(meter["comm_s"], rel=1e-12)


@pytest.mark.slow
def test_console_hint_follows_the_logged_fractions(run):
    run_dir, first, _ = run
    records = read_metrics(run_dir)[:3]
    fractions = [r["perf/comm_fraction"] for r in records]
    top = max(GROUPS, key=lambda g: records[-1][f"perf/comm_fraction_{g}"])
    hinted = "[rlhf-hpc] communication took" in first
    # (on CPU, waiting at the all-reduces, "other", has no advice: ranks sharing cores wait by contention)
    assert hinted == (all(f > 0.2 for f in fractions) and top != "other"), (fractions, top, first[-2000:])
    assert first.count("[rlhf-hpc] communication took") <= 1


@pytest.mark.slow
def test_meter_counts_hsdp_replicate_all_reduces(tmp_path):
    """4 ranks on a (2, 2) HSDP mesh: FSDP2's replicate all-reduce (timed through its all-reduce
    hook) is counted like every other collective. Time is compared on the 2-rank run above only:
    4 ranks on 2 cores spend long stretches descheduled inside collectives, which the meter counts
    and the profiler's gloo events do not."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=4",
            str(REPO / "tests" / "dist_profiling_checks.py"),
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for rank in range(4):
        trace = json.loads((tmp_path / "step2" / f"rank{rank}.pt.trace.json").read_text())
        meter = json.loads((tmp_path / "step2" / f"rank{rank}.comm.json").read_text())
        all_reduces = [e for e in trace["traceEvents"] if e.get("name") == "c10d::allreduce_"]
        assert len(all_reduces) == 5  # one per FSDP group: 2 layers, embedding, head, root
        assert meter["calls"] == profiler_comm(trace)[0]


# ------------------------------------------------------------------------------ MLflow
@pytest.mark.slow
def test_mlflow_run_read_back_continues_across_the_resume(run):
    run_dir, _, second = run
    assert "resumed from" in second
    client = MlflowClient(mlflow_tracking_uri(run_dir))
    exp = client.get_experiment_by_name("rlhf-hpc-demo")
    (found,) = client.search_runs([exp.experiment_id])  # one run, not one per launch
    run_id = (run_dir / "mlflow_run_id").read_text()
    extra = torch.load(run_dir / "global_step_4" / "extra.pt", weights_only=True)
    assert found.info.run_id == run_id == extra["mlflow_run_id"]
    assert found.info.run_name == "tiny_klppo" and found.info.status == "FINISHED"
    cfg = load_resolved(run_dir / "config.yaml")
    tags = found.data.tags
    assert tags["recipe"] == "tiny_klppo" and tags["config"] == config_hash(cfg) and tags["group"] == "tiny_klppo"
    params = found.data.params
    assert params["algorithm.kl_ctrl.kl_coef"] == "0.001" and params["trainer.logger"] == '["console", "mlflow"]'
    assert params["trainer.total_training_steps"] == "3"  # the creating launch's: MLflow parameters are fixed
    assert params["trainer.default_local_dir"] == str(run_dir)
    local = client.download_artifacts(run_id, "config.yaml", str(run_dir.parent))
    assert Path(local).read_text() == (run_dir / "config.yaml").read_text()
    jsonl = read_metrics(run_dir)
    for key in ("critic/score/mean", "actor/pg_loss", "perf/comm_fraction", "perf/comm_fraction_train"):
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
        assert [m.step for m in history] == [1, 2, 3, 4]
        assert [m.value for m in history] == pytest.approx([r[key] for r in jsonl], rel=1e-12)


@pytest.mark.slow
def test_compare_reads_mlflow_only_runs(run, tmp_path):
    run_dir, _, _ = run
    run_id = (run_dir / "mlflow_run_id").read_text()
    uri = mlflow_tracking_uri(run_dir)
    # a run directory whose metrics.jsonl is gone: read from its MLflow store
    only_mlflow = tmp_path / "mlflow_only"
    shutil.copytree(run_dir, only_mlflow, ignore=shutil.ignore_patterns("global_step_*", "profile", "metrics.jsonl"))
    shutil.rmtree(only_mlflow / "mlruns")
    shutil.copytree(run_dir / "mlruns", only_mlflow / "mlruns")
    want = series(load_run(run_dir), "critic/score/mean")
    assert want[0] == [1, 2, 3, 4]
    assert series(load_run(only_mlflow), "critic/score/mean") == want
    assert series(load_run(f"mlflow:{run_id}", uri), "critic/score/mean") == want
    _, table, keys = compare([run_dir, f"mlflow:{run_id}"], mlflow_uri=uri)
    assert keys == [] and table[0]["critic/score/mean last"] == table[1]["critic/score/mean last"]
    out = run_launch(
        "compare",
        str(run_dir),
        f"mlflow:{run_id}",
        "--metrics",
        "critic/score/mean,perf/comm_fraction",
        "--out",
        str(tmp_path / "cmp"),
        env={"MLFLOW_TRACKING_URI": uri},
    )
    assert out.returncode == 0, out.stderr
    assert f"mlflow:{run_id}" in out.stdout and "config keys that differ: none" in out.stdout
    out = run_launch(
        "compare", "mlflow:0123456789abcdef", "--out", str(tmp_path / "cmp"), env={"MLFLOW_TRACKING_URI": uri}
    )
    assert out.returncode == 2 and "mlflow:0123456789abcdef: no such run at" in out.stderr


@pytest.mark.slow
def test_mlflow_tracking_uri_from_the_environment(tmp_path, monkeypatch):
    store = tmp_path / "server_store"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    cfg = load_config("tiny_klppo", [f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.logger=[mlflow]"])[0]
    tracker = Tracker(cfg, tmp_path / "run", is_main=True, total_steps=2)
    tracker.log({"val-core/openai/gsm8k/reward/mean@1": 0.5, "critic/score/mean": float("nan")}, step=1)
    tracker.close()
    assert not (tmp_path / "run" / "mlruns").exists()
    got = MlflowClient(store.as_uri()).get_run(tracker.mlflow_id).data.metrics
    assert got["val-core/openai/gsm8k/reward/mean_1"] == 0.5 and got["critic/score/mean"] != got["critic/score/mean"]
    with pytest.raises(RuntimeError, match="MLflow run 0123456789abcdef .* is not in the tracking store file://"):
        Tracker(cfg, tmp_path / "run", is_main=True, total_steps=2, mlflow_id="0123456789abcdef")


def test_mlflow_metric_names_map_rejected_characters_one_way():
    assert mlflow_metric_name("critic/score/mean") == "critic/score/mean"  # the loop's own names stay
    assert mlflow_metric_name("val-core/openai/gsm8k/reward/mean@4") == "val-core/openai/gsm8k/reward/mean_4"
    assert (
        mlflow_metric_name("val-core/synthetic://copy?size=64/reward/mean@1")
        == "val-core/synthetic:/copy_size_64/reward/mean_1"
    )
    assert mlflow_metric_name("a/../b/./c") == "a/_/b/_/c"
    from mlflow.utils.validation import _validate_metric_name

    for name in ("val-core/synthetic://copy?size=64/reward/mean@1", "a/../b/./c", "/lead/", "x" * 300):
        _validate_metric_name(mlflow_metric_name(name))  # MLflow's own check accepts the mapped name


# ------------------------------------------------------------------------------ no launch
def _fractions(total: float, train: float) -> dict[str, float]:
    return {
        "perf/comm_fraction": total,
        "perf/comm_fraction_train": train,
        "perf/comm_fraction_weight_sync": total - train,
        "perf/comm_fraction_rollout": 0.0,
        "perf/comm_fraction_other": 0.0,
    }


def test_hint_after_three_steps_over_a_fifth_once_per_run():
    # sharded (fsdp_size=2): FSDP's keys the recipe leaves open are there to name
    hint = CommHint(load_config("tiny_klppo", ["actor_rollout_ref.actor.fsdp_config.fsdp_size=2"])[0])
    said = [
        hint.update(_fractions(f, f * 0.9))
        for f in (0.3, 0.3, 0.1, 0.3, 0.25, 0.4, 0.5, 0.6, 0.2, 0.1, 0.3, 0.3, 0.3, 0.3)
    ]
    assert [i for i, s in enumerate(said) if s] == [3 + HINT_STEPS - 1]  # the second stretch says nothing
    assert "most in train" in said[5] and "fsdp_config.forward_prefetch=true" in said[5]
    assert "ppo_micro_batch_size_per_gpu" not in said[5]  # tiny_klppo sets it (4)
    assert "fsdp_size" not in said[5]  # one node already shards inside the node


def test_hint_leaves_what_the_recipe_chose_alone():
    cfg = load_config("tiny_klppo")[0]
    assert {
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
    } <= cfg.recipe_keys and "actor_rollout_ref.rollout.update_weights_bucket_mb" not in cfg.recipe_keys
    # the demo's model is replicated (rlhf_hpc.planning.layout): its one collective is the gradient all-reduce,
    # whose one key the recipe set (and a bf16 reduce would leave the CPU's shared-memory path)
    hint = CommHint(cfg)
    assert hint.keys_for("train") == "" and hint.keys_for("rollout") == ""
    assert not any(hint.update(_fractions(0.5, 0.45)) for _ in range(10))  # nothing to say: silent
    assert "update_weights_bucket_mb (now" in hint.keys_for("weight_sync")  # left at its default
    assert hint.keys_for("other") == ""  # CPU ranks share the cores: their waiting is contention
    cfg.recipe_keys = frozenset()  # a recipe that left everything open
    assert "ppo_mini_batch_size, now 8" in CommHint(cfg).keys_for("train")
    assert "reduce_dtype" not in CommHint(cfg).keys_for("train")
    multi = load_config("qwen7b_klppo_4node", check_files=False)[0]
    assert "fsdp_size" not in CommHint(multi).keys_for("train")  # that recipe is HSDP already (8 per node)
    multi = load_config("qwen7b_klppo_4node", ["actor_rollout_ref.actor.fsdp_config.fsdp_size=-1"], check_files=False)[
        0
    ]
    assert "fsdp_config.fsdp_size=8 (now -1" in CommHint(multi).keys_for("train")  # the override is advised


def test_a_run_keeps_what_its_recipe_chose(tmp_path):
    from rlhf_hpc.recipe.load import load_resolved, write_resolved

    cfg = load_config("tiny_klppo", ["actor_rollout_ref.actor.optim.lr=2e-3"])[0]
    write_resolved(cfg, tmp_path)
    again = load_resolved(tmp_path / "config.yaml")
    assert again.recipe_keys == cfg.recipe_keys and "actor_rollout_ref.actor.optim.lr" in again.recipe_keys
    assert again.actor_rollout_ref.actor.optim.lr == 2e-3 and "trainer.device" in again.recipe_keys
    (tmp_path / "recipe.yaml").unlink()  # a run directory from before: every key open to advice
    assert load_resolved(tmp_path / "config.yaml").recipe_keys == frozenset()


def test_profiler_ranks_and_save_path_choose_what_is_traced_where(tmp_path):
    cfg = load_config(
        "tiny_klppo",
        [
            "global_profiler.steps=[2]",
            "global_profiler.ranks=[1]",
            f"global_profiler.save_path={tmp_path / 'elsewhere'}",
        ],
    )[0]
    for rank in (0, 1):
        profiler = StepProfiler(cfg, rank, torch.device("cpu"), tmp_path / "run")
        for step in (1, 2):
            timer = Timer()
            with profiler.step(step, timer), timer("step"):
                with timer("update_actor"), collective(calls=3):  # three collectives of the actor update
                    torch.ones(1000).cumsum(0)
                with collective():  # one outside any phase
                    pass
            m = profiler.metrics(timer.times)
            assert m["perf/comm_fraction_train"] > 0 and m["perf/comm_fraction_weight_sync"] == 0
            assert m["perf/comm_fraction"] == pytest.approx(
                m["perf/comm_fraction_train"] + m["perf/comm_fraction_other"]
            )
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["elsewhere/step2/rank1.comm.json", "elsewhere/step2/rank1.pt.trace.json"]
    summary = json.loads((tmp_path / "elsewhere" / "step2" / "rank1.comm.json").read_text())
    assert summary["calls"] == 4 and summary["by_phase_s"]["train"] > 0
    trace = json.loads((tmp_path / "elsewhere" / "step2" / "rank1.pt.trace.json").read_text())
    assert {"phase/step", "phase/update_actor"} <= {e["name"] for e in trace["traceEvents"]}


def test_profiler_keys_are_checked():
    cfg = load_config("tiny_klppo", ["trainer.profile_steps=[3,4]", "global_profiler.ranks=[1]"])[0]
    assert cfg.global_profiler.steps == [3, 4] and cfg.global_profiler.ranks == [1]
    with pytest.raises(ConfigError, match=r"global_profiler.steps: \[0\] are not global steps"):
        load_config("tiny_klppo", ["global_profiler.steps=[0,2]"])
    with pytest.raises(ConfigError, match=r"global_profiler.ranks: \[2\] are not ranks of this job \(0..1\)"):
        load_config("tiny_klppo", ["global_profiler.ranks=[2]"])
    with pytest.raises(ConfigError, match="global_profiler.tool='nsys': rlhf-hpc traces steps with torch.profiler"):
        load_config("tiny_klppo", ["global_profiler.tool=nsys"])
    with pytest.raises(ConfigError, match="launcher.nsys=true wraps the nodes of a Slurm job"):
        load_config("tiny_klppo", ["launcher.nsys=true", "cluster=local"])


def test_nsys_sbatch_matches_the_golden_file(tmp_path):
    out = launch_here(
        "recipe=qwen7b_klppo",
        "cluster=slurm",
        "launcher.cluster_profile=example-gpu",
        "--dry-run",
        f"trainer.default_local_dir={tmp_path}/run",
        "launcher.nsys=true",
    )
    assert out.returncode == 0, out.stderr
    script = out.stdout.split("# sbatch script (cluster=slurm)\n", 1)[1]
    script = script.replace(str(tmp_path), "<TMP>").replace(sys.executable, "<PYTHON>")
    if os.environ.get("RLHF_HPC_UPDATE_GOLDEN"):
        NSYS_GOLDEN.write_text(script)
    assert script == NSYS_GOLDEN.read_text()
    assert "nsys profile --trace=cuda,nvtx,osrt" in script and "mkdir -p <TMP>/run/profile" in script


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc/self/clear_refs")
def test_timer_keeps_each_phase_peak_and_the_runs_peak():
    """Phase peaks (``memory_gb/<phase>``) restart at each phase; the outer phase and the run's peak
    (``perf/max_memory_allocated_gb``) still see the largest inner one."""
    from rlhf_hpc.observability.perf import memory_metrics

    cpu = torch.device("cpu")
    timer = Timer(cpu)
    with timer("step"):
        with timer("big"):
            x = torch.ones(384 * 2**20 // 4)  # 384 MiB, touched; freed at once (mmap'd: back to the OS)
            del x
        with timer("small"):
            y = torch.ones(1024)
            del y
    big, small, step = (timer.peaks[f"memory_gb/{n}"] for n in ("big", "small", "step"))
    assert big - small > 0.3, timer.peaks
    assert step >= big
    assert memory_metrics(cpu)["perf/max_memory_allocated_gb"] >= big
    assert set(timer.times) == {"timing_s/step", "timing_s/big", "timing_s/small"}
