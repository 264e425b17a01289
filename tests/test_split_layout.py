"""The split layout (actor_rollout_ref.hybrid_engine=false): rollout ranks apart from the trainer's
in one torchrun job, generation running ahead of the update by async_training.* (rlhf_hpc/ppo/split_rollout.py,
rlhf_hpc/distributed/split_layout.py)."""

from __future__ import annotations

import pytest

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.distributed.rows import RolloutRow, share_rows
from rlhf_hpc.distributed.split_layout import split_role
from rlhf_hpc.launch.local import standalone_torchrun_command
from rlhf_hpc.observability.tracking import read_metrics
from rlhf_hpc.ppo.split_rollout import runs_ahead
from rlhf_hpc.recipe.load import load_config
from tests.conftest import launch_here, run_launch

SPLIT = ["actor_rollout_ref.hybrid_engine=false", "rollout.n_gpus_per_node=1", "trainer.guard.enable=false"]


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
    assert runs_ahead(cfg) == ahead


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
        ([*SPLIT[:2]], "trainer.guard.enable=true"),
        ([*SPLIT, "trainer.test_freq=5"], "validation"),
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
    assert recipe.split and runs_ahead(recipe) == 1 and recipe.algorithm.rollout_correction.rollout_is == "token"


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


# ------------------------------------------------------------------------------------ slow
def staleness_zero(tmp_path, split: bool) -> list[dict]:
    run = tmp_path / ("split" if split else "colocated")
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
        f"trainer.default_local_dir={run}",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return read_metrics(run)


@pytest.mark.slow
def test_a_synchronous_hand_off_trains_exactly_as_the_colocated_layout(tmp_path):
    """Staleness 0 with one trainer and one rollout rank against the colocated layout on one rank:
    the same prompts, the same sampling seeds, the same weights in the same engine, so the same
    rows; the update is the same code on the same rows. Measured: equal to the bit (vLLM's CPU
    build and transformers' generate are deterministic here), asserted to 1e-6 relative (a
    trainer process without an engine may schedule its threads otherwise)."""
    split, colocated = staleness_zero(tmp_path, True), staleness_zero(tmp_path, False)
    assert [m["training/global_step"] for m in split] == [1, 2, 3]
    for a, b in zip(split, colocated):
        assert a["rollout/staleness/max"] == 0.0 and a["timing_s/gen_overlapped"] == 0.0
        assert a["response_length/mean"] == b["response_length/mean"]
        for key in ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key


@pytest.mark.slow
def test_one_step_off_trains_rows_one_update_stale_generated_while_the_trainer_updated(tmp_path):
    """The async recipe as written (2 trainer ranks, 1 rollout rank): from the second step on, each
    step trains rows the previous weights generated, generated while the trainer updated; then a
    resume from step 3's checkpoint trains steps 4-5 only, its first rows fresh from the checkpoint."""
    run = tmp_path / "run"
    args = ["recipe=tiny_grpo_async", "trainer.save_freq=3", f"trainer.default_local_dir={run}"]
    out = run_launch(*args, "trainer.total_training_steps=3")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    metrics = read_metrics(run)
    assert [m["rollout/staleness/max"] for m in metrics] == [0.0, 1.0, 1.0]
    assert [m["rollout/policy_version"] for m in metrics] == [0.0, 0.0, 1.0]
    assert all(m["timing_s/gen_overlapped"] > 0 for m in metrics[1:])
    assert all(0 <= m["async/trainer_idle_share"] <= 1 and 0 <= m["async/rollout_idle_share"] <= 1 for m in metrics)
    for m in metrics[1:]:  # stale rows are corrected (truncated importance weights), not checked as the engine's
        assert m["rollout_corr/kl"] > 0 and "rollout_corr/rollout_is_mean" in m
    resumed = run_launch(*args, "trainer.total_training_steps=5")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    after = read_metrics(run)
    assert [m["training/global_step"] for m in after] == [1, 2, 3, 4, 5]
    assert after[3]["rollout/staleness/max"] == 0.0 and after[3]["rollout/policy_version"] == 3.0
    assert after[4]["rollout/staleness/max"] == 1.0
