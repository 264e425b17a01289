"""The split layout (actor_rollout_ref.hybrid_engine=false): rollout ranks apart from the trainer's
in one torchrun job, generation running ahead of the update by async_training.* (rlhf_hpc/ppo/split_rollout.py,
rlhf_hpc/distributed/split_layout.py)."""

from __future__ import annotations

import json
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.distributed.rows import RolloutRow, share_rows
from rlhf_hpc.distributed.split_layout import split_role
from rlhf_hpc.launch.failure import LATEST_FILE, LOST_RANK
from rlhf_hpc.launch.local import standalone_torchrun_command
from rlhf_hpc.observability.tracking import read_metrics
from rlhf_hpc.recipe.load import load_config
from tests.conftest import REPO, launch_here, run_launch
from tests.test_run_lifecycle import processes_of

SPLIT = ["actor_rollout_ref.hybrid_engine=false", "rollout.n_gpus_per_node=1"]


def config(*overrides: str):
    return load_config("tiny_klppo", ["trainer.test_freq=-1", *overrides])[0]


# ------------------------------------------------------------------------------------ fast
def test_each_node_holds_its_trainer_ranks_then_its_rollout_ranks():
    cfg = config(
        *SPLIT,
        "trainer.nnodes=2",
        "rollout.nnodes=2",
        "rollout.n_gpus_per_node=2",
        "trainer.n_gpus_per_node=4",
        "launcher.cluster=slurm",
    )
    cfg.trainer.n_gpus_per_node = 3  # (a shape the batch sizes refuse: the mapping alone is under test)
    assert cfg.procs_per_node == 5 and cfg.world_size == 6 and cfg.rollout_world_size == 4
    roles = [split_role(cfg, g) for g in range(10)]
    assert [(r.role, r.rank) for r in roles] == [
        ("trainer", 0), ("trainer", 1), ("trainer", 2), ("rollout", 0), ("rollout", 1),
        ("trainer", 3), ("trainer", 4), ("trainer", 5), ("rollout", 2), ("rollout", 3),
    ]  # fmt: skip
    assert roles[0].trainer_ranks == [0, 1, 2, 5, 6, 7] and roles[0].rollout_ranks == [3, 4, 8, 9]
    assert all(r.size == (6 if r.is_trainer else 4) for r in roles)


def test_torchrun_starts_both_sides_and_the_colocated_command_is_unchanged(tmp_path):
    split = standalone_torchrun_command(config(*SPLIT, "trainer.n_gpus_per_node=2"), tmp_path / "config.yaml")
    colocated = standalone_torchrun_command(config("trainer.n_gpus_per_node=2"), tmp_path / "config.yaml")
    assert "--nproc-per-node=3" in split and "--nproc-per-node=2" in colocated


@pytest.mark.parametrize(
    "staleness,trigger,ahead", [(0, 1, 0), (1, 1, 1), (0.5, 2, 1), (0.25, 4, 1), (2, 1, 2), (0, 4, 0)]
)
def test_the_rollout_runs_ahead_by_whole_batches(staleness, trigger, ahead):
    cfg = config(
        *SPLIT,
        f"async_training.staleness_threshold={staleness}",
        f"async_training.trigger_parameter_sync_step={trigger}",
    )
    assert cfg.async_training.runs_ahead == ahead


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["async_training.staleness_threshold=1"], "set actor_rollout_ref.hybrid_engine=false"),
        (["rollout.n_gpus_per_node=2"], "rollout.n_gpus_per_node"),
        ([*SPLIT, "rollout.n_gpus_per_node=0"], "the split layout needs rollout ranks"),
        ([*SPLIT, "async_training.staleness_threshold=0.1"], "whole batches"),
        ([*SPLIT, "async_training.trigger_parameter_sync_step=0"], "1 or more"),
        ([*SPLIT, "async_training.partial_rollout=true"], "async_training.partial_rollout=true"),
        ([*SPLIT, "async_training.require_batches=4"], "async_training.require_batches=4"),
        ([*SPLIT, "rollout.nnodes=2"], "set rollout.nnodes=1"),
        ([*SPLIT, "actor_rollout_ref.rollout.tensor_model_parallel_size=2"], "does not divide"),
        ([*SPLIT, "trainer.inject_fault=wrong_weights@2"], "a fault of the colocated weight sync"),
        ([*SPLIT, "algorithm.filter_groups.enable=true"], "DAPO"),
        ([*SPLIT, "actor_rollout_ref.model.lora_rank=8"], "LoRA"),
    ],
)
def test_what_the_split_layout_does_not_run_is_refused_by_name(overrides, words):
    with pytest.raises(ConfigError) as e:
        config(*overrides)
    assert words in str(e.value)


def test_stale_rows_without_a_correction_are_named_and_the_recipe_corrects_them():
    from rlhf_hpc.recipe.split_checks import split_layout_warnings

    stale = config(*SPLIT, "async_training.staleness_threshold=1", "algorithm.rollout_correction.rollout_is=null")
    assert "rows up to 1 updates stale" in " ".join(split_layout_warnings(stale))
    assert split_layout_warnings(config(*SPLIT)) == []  # staleness 0, a sync every update: none stale
    recipe = load_config("tiny_grpo_async", [])[0]
    assert (
        recipe.split
        and recipe.async_training.runs_ahead == 1
        and recipe.algorithm.rollout_correction.rollout_is == "token"
    )


def test_every_trainer_rank_takes_the_share_redistribute_rows_gives(monkeypatch):
    rows = [RolloutRow(i // 2, i, [1] * (i % 5 + 1), [2] * (7 - i % 3), [0.0], "stop") for i in range(12)]
    for balance in (False, True):
        shares = [share_rows(rows, 3, r, balance) for r in range(3)]
        taken = sorted(id(row) for part, _ in shares for row in part)
        assert taken == sorted(id(r) for r in rows) and all(len(p) == 4 for p, _ in shares)
        assert len({tuple(sorted(m.items())) for _, m in shares}) == 1  # the same metrics on every rank


def test_the_async_recipe_dry_runs_with_both_sides_in_its_command():
    out = launch_here("recipe=tiny_grpo_async", "--dry-run")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "--nproc-per-node=3" in out.stdout


GPU_SPLIT = [
    "actor_rollout_ref.hybrid_engine=false",
    "trainer.n_gpus_per_node=4",
    "rollout.n_gpus_per_node=4",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
    "algorithm.rollout_correction.rollout_is=token",
]


def test_a_trainer_rank_plans_no_engine_and_a_rollout_rank_only_its_engine():
    from rlhf_hpc.planning.memory_plan import build_plan

    split = load_config("qwen7b_klppo", [*GPU_SPLIT], check_files=False)[0]
    colocated = load_config("qwen7b_klppo", ["trainer.n_gpus_per_node=4"], check_files=False)[0]
    s, c = build_plan(split), build_plan(colocated)
    gen = next(p for p in s.phases if p.name == "gen")
    assert set(gen.parts) == {"runtime", "vLLM (gpu_memory_utilization)"}  # no training state beside it
    for name in ("old_log_prob", "update_actor"):
        (a,) = [p for p in s.phases if p.name == name]
        (b,) = [p for p in c.phases if p.name == name]
        assert not any("vLLM" in k for k in a.parts) and a.parts == {
            k: v for k, v in b.parts.items() if "vLLM" not in k
        }


def test_the_trainers_time_plan_sends_weights_and_generates_nothing():
    from rlhf_hpc.planning.time_plan import build_time_plan

    split = build_time_plan(load_config("qwen7b_klppo", [*GPU_SPLIT], check_files=False)[0])
    colocated = build_time_plan(load_config("qwen7b_klppo", ["trainer.n_gpus_per_node=4"], check_files=False)[0])
    assert split.phase("gen") is None and colocated.phase("gen") is not None
    send = [k for k in split.phase("update_weights").parts if k.startswith("to the rollout ranks")]
    assert send and not any(k.startswith("to the rollout ranks") for k in colocated.phase("update_weights").parts)
    for name in ("old_log_prob", "update_actor"):  # the same training on the same 4 ranks
        assert split.phase(name).seconds == pytest.approx(colocated.phase(name).seconds)


@pytest.mark.parametrize("staleness,trigger", [(1, 1), (0, 1), (0, 2), (0.5, 2)])
def test_the_split_step_is_the_slower_side_when_generation_runs_ahead(staleness, trigger):
    from rlhf_hpc.planning.split_plan import split_step_s
    from rlhf_hpc.planning.time_plan import build_time_plan

    cfg = load_config(
        "qwen7b_klppo",
        [
            *GPU_SPLIT,
            f"async_training.staleness_threshold={staleness}",
            f"async_training.trigger_parameter_sync_step={trigger}",
        ],
        check_files=False,
    )[0]
    trainer = build_time_plan(cfg)
    t = trainer.step_s
    for gen in (0.5 * t, 2 * t):
        step = split_step_s(cfg, trainer, gen)
        assert max(t, gen) <= step <= t + gen + 1e-9
        if cfg.async_training.runs_ahead:
            assert step == pytest.approx(max(t, gen))
        elif trigger == 1:
            assert step == pytest.approx(t + gen)  # a synchronous hand-off: one after the other


def test_the_dry_run_compares_the_split_layout_with_the_colocated_one_on_the_same_ranks():
    from rlhf_hpc.planning.split_plan import colocated_twin, compare_layouts, split_step_s
    from rlhf_hpc.planning.time_plan import TimeModel, build_time_plan
    from rlhf_hpc.recipe.config_checks import validate

    cfg = load_config("qwen7b_klppo", [*GPU_SPLIT, "async_training.staleness_threshold=1"], check_files=False)[0]
    trainer = build_time_plan(cfg)
    lines = compare_layouts(cfg, trainer, lambda c: validate(c, check_files=False))
    twin = colocated_twin(cfg)
    assert twin.world_size == 8 and not twin.split and twin.procs_per_node == 8
    step = split_step_s(cfg, trainer, TimeModel(cfg).generation(trainer.workload).seconds)
    colocated = build_time_plan(twin).step_s
    assert lines[0].startswith("split layout, 4 trainer + 4 rollout rank(s)") and f"step {step:.3g} s" in lines[0]
    faster = "split" if step < colocated else "colocated"
    assert (
        f"step {colocated:.3g} s; the {faster} layout is {max(step, colocated) / min(step, colocated):.2f}x faster"
        in lines[1]
    )
    out = launch_here("recipe=qwen7b_klppo", *GPU_SPLIT, "async_training.staleness_threshold=1", "--dry-run")
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"# layouts: {lines[0]}" in out.stdout and f"# layouts: {lines[1]}" in out.stdout


VERL_ASYNC = yaml.safe_load((Path(__file__).parent / "golden" / "verl_async_examples.yaml").read_text())


def verl_async_args(name: str, home: Path) -> list[str]:
    return shlex.split(VERL_ASYNC[name].replace("$HOME", str(home)))


@pytest.mark.parametrize(
    "name,refused",
    [
        (
            "dapo_7b_math_fsdp2_4_4",
            ["data.gen_batch_size=1", "staleness_threshold=0.1", "partial_rollout=true"],
        ),
        (
            "dapo_30b_a3b_base_math_fsdp",
            ["data.gen_batch_size=1", "staleness_threshold=0.6", "partial_rollout=true"],
        ),
    ],
)
def test_verls_fully_async_lines_are_read_and_what_is_not_built_is_refused_by_name(tmp_path, name, refused):
    out = launch_here(*verl_async_args(name, tmp_path), "cluster=slurm", "--dry-run")
    assert out.returncode != 0 and "unknown key" not in out.stderr, out.stderr[-3000:]
    problems = [line for line in out.stderr.splitlines() if line.startswith("  - ")]
    assert len(problems) == len(refused) and all(any(r in p for p in problems) for r in refused), problems


def test_verls_4_4_line_with_what_is_built_dry_runs_in_verls_sizes(tmp_path):
    """The 4+4 GPU line with its four refused keys changed: verl's step of require_batches x
    ppo_mini_batch_size prompts (4 x 32), total_rollout_steps in prompts (51,200: 400 steps), the engine's
    log-probs as the anchor (use_rollout_log_probs: bypass mode), 4 trainer and 4 rollout ranks a node."""
    args = [a for a in verl_async_args("dapo_7b_math_fsdp2_4_4", tmp_path) if not a.startswith("data.gen_batch_size=")]
    args = [
        {
            "async_training.staleness_threshold=0.1": "async_training.staleness_threshold=0.25",
            "async_training.partial_rollout=True": "async_training.partial_rollout=False",
        }.get(a, a)
        for a in args
    ]
    out = launch_here(*args, "cluster=local", "--dry-run")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--nproc-per-node=8" in out.stdout and "# layouts: split layout, 4 trainer + 4 rollout rank(s)" in out.stdout
    cfg = load_config(None, [*args, "cluster=local"], check_files=False)[0]
    assert cfg.data.train_batch_size == 128 and cfg.trainer.total_training_steps == 400
    assert cfg.algorithm.rollout_correction.bypass_mode and cfg.world_size == 4 and cfg.rollout_world_size == 4
    assert cfg.trainer.test_freq == 10 * 4  # rollout.test_freq=10 weight syncs, one every 4 steps


def test_verls_fully_async_validation_counts_weight_syncs(tmp_path):
    """verl's fully-async trainer validates every trainer.test_freq parameter versions (syncs), and its
    lines say the same in rollout.test_freq: the 30B line's 25 syncs of 16 steps each are 400 steps."""
    fixed = {
        "async_training.staleness_threshold=0.6": "async_training.staleness_threshold=0.0625",
        "async_training.partial_rollout=True": "async_training.partial_rollout=False",
    }
    args = [
        fixed.get(a, a)
        for a in verl_async_args("dapo_30b_a3b_base_math_fsdp", tmp_path)
        if not a.startswith("data.gen_batch_size=")
    ]
    cfg = load_config(None, [*args, "cluster=slurm"], check_files=False)[0]
    assert cfg.async_training.trigger_parameter_sync_step == 16 and cfg.data.train_batch_size == 32
    assert cfg.trainer.test_freq == 25 * 16 and cfg.async_training.runs_ahead == 1
    with pytest.raises(ConfigError) as e:
        load_config(None, [*args, "cluster=slurm", "rollout.test_freq=5"], check_files=False)
    assert "rollout.test_freq=5 and trainer.test_freq=25 both set the validation's interval" in str(e.value)


# ------------------------------------------------------------------------------------ slow
def staleness_zero(tmp_path, split: bool, *extra: str) -> list[dict]:
    run = tmp_path / (("split" if split else "colocated") + "".join(f"-{e}" for e in extra))
    layout = (
        ["rollout.n_gpus_per_node=1"]
        if split
        else ["actor_rollout_ref.hybrid_engine=true", "rollout.n_gpus_per_node=0"]
    )
    out = run_launch(
        "recipe=tiny_grpo_async",
        *layout,
        "trainer.n_gpus_per_node=1",
        "async_training.staleness_threshold=0",
        "trainer.total_training_steps=3",
        "trainer.save_freq=-1",
        "trainer.test_freq=2",
        "trainer.val_before_train=true",
        f"trainer.default_local_dir={run}",
        *extra,
        # one thread a rank on any machine: a colocated rank's in-process vLLM binds it to one core, and a
        # trainer rank without an engine would otherwise take the launcher's share of the cores
        env={"OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return read_metrics(run)


@pytest.mark.slow
def test_a_synchronous_hand_off_trains_exactly_as_the_colocated_layout(tmp_path):
    """Staleness 0 with one trainer and one rollout rank against the colocated layout on one rank:
    the same prompts, the same sampling seeds, the same weights in the same engine, so the same
    rows; the update is the same code on the same rows. Measured: equal to the bit (vLLM's CPU
    build and transformers' generate are deterministic here), asserted to 1e-6 relative (a
    trainer process without an engine may schedule its threads otherwise). Validation (before
    training, every 2 steps, at the end) runs on the rollout rank and scores the same, and so does
    an evaluation run (``trainer.val_only``) of the split layout: one row, no step trained."""
    split, colocated = staleness_zero(tmp_path, True), staleness_zero(tmp_path, False)
    assert [m["training/global_step"] for m in split] == [0, 1, 2, 3]
    val = "val-core/synthetic/copy/reward/mean@1"
    assert [m.get(val) for m in split] == [m.get(val) for m in colocated] and split[0][val] is not None
    (evaluated,) = staleness_zero(tmp_path, True, "trainer.val_only=true")
    assert evaluated["training/global_step"] == 0 and evaluated[val] == split[0][val]
    assert not any(k.startswith(("actor/", "timing_s/update")) for k in evaluated)
    assert [m["training/global_step"] for m in split if val in m] == [0, 2, 3]
    split, colocated = split[1:], colocated[1:]
    for a, b in zip(split, colocated):
        assert a["rollout/staleness/max"] == 0.0
        assert a["response_length/mean"] == b["response_length/mean"]
        for key in ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key


@pytest.mark.slow
def test_a_killed_rollout_rank_ends_the_run_at_once_with_one_line_and_code_4(tmp_path):
    """The rollout rank (torchrun's rank 2) dies after generating step 2's batch: the trainer's next
    exchange with it fails, and the launcher names the lost rank, as for a trainer rank."""
    run = tmp_path / "run"
    out = run_launch(
        "recipe=tiny_grpo_async",
        f"trainer.default_local_dir={run}",
        "trainer.total_training_steps=3",
        "trainer.inject_fault=kill@2:2",
        timeout=600,
    )
    assert out.returncode == LOST_RANK, out.stdout[-3000:] + out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith(f"[rlhf-hpc] run failed: rank 2 on {socket.gethostname()}, pid "), line
    assert "the process died without an error of its own" in line and line.endswith(
        f"exit code {LOST_RANK} (lost rank)"
    )
    assert out.stderr.count("Traceback") == 0 and processes_of(run) == []


@pytest.mark.slow
def test_sigterm_stops_both_sides_and_the_resume_trains_every_step_once(tmp_path):
    """SIGTERM to the launcher: the trainer finishes its step, saves, and stops the rollout rank (its
    rows generated ahead are dropped); the resume starts the rollout rank from the checkpoint, and
    every step is trained and logged once."""
    run, steps = tmp_path / "run", 4
    # slow@1: every step 1 s longer on every rank, so the run is still going when the test stops it
    args = [
        "recipe=tiny_grpo_async",
        f"trainer.default_local_dir={run}",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=100",
        "trainer.inject_fault=slow@1",
    ]
    first = subprocess.Popen(
        [sys.executable, str(REPO / "launch.py"), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert first.poll() is None, "the run ended before the test could stop it"
        assert len(list((run / "heartbeat").glob("rank*.json"))) == 3  # both sides beat
        first.send_signal(signal.SIGTERM)
        stdout, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 143, stdout[-3000:] + stderr[-3000:]
    stopped_at = int((run / LATEST_FILE).read_text())
    assert 1 <= stopped_at < steps and processes_of(run) == []
    assert f"stopping after step {stopped_at}: stop requested (signal SIGTERM); checkpoint saved" in stdout
    again = run_launch(*args, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    logged = [json.loads(line)["training/global_step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, steps + 1))  # every step once, none repeated, none skipped
    resumed = read_metrics(run)[stopped_at]  # the first resumed step: fresh rows from the checkpoint's weights
    assert resumed["rollout/staleness/max"] == 0.0 and resumed["rollout/policy_version"] == stopped_at


@pytest.mark.slow
def test_one_step_off_trains_stale_rows_and_a_guard_rollback_restarts_the_rollout_ranks(tmp_path):
    """The async recipe (2 trainer ranks, 1 rollout rank): from the second step on, each step trains
    rows the previous weights generated, generated while the trainer updated, and corrected as stale
    (truncated importance weights), not checked as the engine's. The stability guard then rejects step
    3 (a NaN loss) and goes back to step 2's checkpoint: the rollout rank, one batch ahead, restarts
    from those weights and that sampler, its rows past step 2 dropped. The repeated step 3 trains on
    fresh rows from the checkpoint's weights and the same prompts; the run finishes. (A resume:
    test_sigterm_stops_both_sides_and_the_resume_trains_every_step_once.)"""
    run = tmp_path / "run"
    out = run_launch(
        "recipe=tiny_grpo_async",
        f"trainer.default_local_dir={run}",
        "trainer.total_training_steps=5",
        "trainer.save_freq=1",
        "trainer.inject_fault=nan_grad@3",
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[rlhf-hpc] step 3: stability guard tripped: actor/pg_loss is nan" in out.stdout
    assert f"rolled back to {run}/global_step_2 (step 2)" in out.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["training/global_step"] for r in rows] == [1, 2, 3, 3, 4, 5]
    assert [r["rollout/staleness/max"] for r in rows[:3]] == [0.0, 1.0, 1.0]
    assert [r["rollout/policy_version"] for r in rows[:3]] == [0.0, 0.0, 1.0]
    assert all(0 <= r["async/trainer_idle_share"] <= 1 and 0 <= r["async/rollout_idle_share"] <= 1 for r in rows)
    stale = [r for r in rows if r["rollout/staleness/max"] == 1.0]
    assert len(stale) == 4 and all(r["timing_s/gen_overlapped"] > 0 for r in stale)
    assert all(r["rollout_corr/kl"] > 0 and "rollout_corr/rollout_is_mean" in r for r in stale)
    tripped, again = rows[2], rows[3]
    assert tripped["rollout/staleness/max"] == 1.0 and tripped["rollout/policy_version"] == 1.0
    assert again["rollout/staleness/max"] == 0.0 and again["rollout/policy_version"] == 2.0  # fresh from step 2
    assert [r["rollout/staleness/max"] for r in rows[4:]] == [1.0, 1.0]
    assert read_metrics(run)[-1]["guard/rollbacks"] == 1.0
