"""Run comparison (``launch.py compare``) and W&B grouping, on real tiny runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_hpc.observability.compare import compare, load_run, series
from rlhf_hpc.recipe.load import load_config, write_resolved
from tests.conftest import launch_here, run_launch, wandb_run_record

KL_KEY = "algorithm.kl_ctrl.kl_coef"


def tiny_run(run: Path, *extra: str, env=None):
    out = run_launch(
        "recipe=tiny_klppo",
        f"trainer.default_local_dir={run}",
        "actor_rollout_ref.rollout.name=hf",
        "trainer.total_training_steps=3",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        *extra,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    runs = [root / "kl_small", root / "kl_big"]
    tiny_run(
        runs[0],
        f"{KL_KEY}=0.001",
        "trainer.logger=[console,wandb]",
        "trainer.experiment_name=kl-small",
        env={"WANDB_MODE": "offline"},
    )
    tiny_run(runs[1], f"{KL_KEY}=0.05")
    return runs


@pytest.mark.slow
def test_compare_plots_one_panel_per_metric_and_one_line_per_run(two_runs, tmp_path):
    fig, table, keys = compare(two_runs, out=tmp_path)
    assert keys == [KL_KEY, "trainer.logger"]
    panels = fig.axes
    assert [ax.get_title() for ax in panels] == [
        "critic/score/mean",
        "actor/reward_kl_penalty",
        "response_length/mean",
        "actor/pg_clipfrac",
        "critic/vf_loss",
        "perf/throughput",
    ]
    for ax in panels:
        assert len(ax.get_lines()) == 2
        assert [list(line.get_xdata()) for line in ax.get_lines()] == [[1, 2, 3], [1, 2, 3]]
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["kl_coef=0.001, logger=['console', 'wandb']", "kl_coef=0.05, logger=['console']"]
    assert "experiment_name" not in " ".join(labels)  # run names are not what differs about the runs
    import matplotlib.image

    png = matplotlib.image.imread(tmp_path / "compare.png")
    assert png.ndim == 3 and png.shape[0] > 100 and png.shape[1] > 100
    assert table[0]["differs"].startswith(f"{KL_KEY}=0.001") and table[1]["differs"].startswith(f"{KL_KEY}=0.05")
    assert table[0]["critic/score/mean last"] == series(load_run(two_runs[0]), "critic/score/mean")[1][-1]
    assert "| run | differs | steps |" in (tmp_path / "compare.md").read_text()
    assert (tmp_path / "compare.csv").read_text().startswith("run,differs,steps,")


@pytest.mark.slow
def test_compare_command_prints_the_table(two_runs, tmp_path):
    out = launch_here(
        "compare", *map(str, two_runs), "--metrics", "critic/score/mean,critic/vf_loss", "--out", str(tmp_path)
    )
    assert out.returncode == 0, out.stderr
    assert f"config keys that differ: {KL_KEY}, trainer.logger" in out.stdout
    assert (
        "| critic/score/mean last | critic/score/mean best | critic/vf_loss last | critic/vf_loss best |" in out.stdout
    )


def test_requeued_and_running_runs_are_read_in_step_order(tmp_path):
    run = tmp_path / "run"
    write_resolved(load_config("tiny_klppo", [f"trainer.default_local_dir={run}"])[0], run)
    # steps 2-3 logged twice (a resume after the step-1 checkpoint), step 4 still in progress
    lines = [
        {"training/global_step": s, "critic/score/mean": v}
        for s, v in [(1, 0.1), (2, 0.2), (3, 0.3), (2, 0.25), (3, 0.35), (4, 0.4)]
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert series(load_run(run), "critic/score/mean") == ([1, 2, 3, 4], [0.1, 0.25, 0.35, 0.4])


@pytest.mark.slow
def test_bad_input_names_the_problem(two_runs, tmp_path):
    out = launch_here("compare", str(two_runs[0]), str(tmp_path))
    assert out.returncode == 2 and f"{tmp_path} is not a run directory (no config.yaml or metrics.jsonl)" in out.stderr
    out = launch_here("compare", *map(str, two_runs), "--metrics", "critic/score/men", "--out", str(tmp_path))
    assert out.returncode == 2
    assert "no run has the metric(s): critic/score/men (did you mean critic/score/mean?)" in out.stderr


@pytest.mark.slow
def test_wandb_offline_run_holds_group_tags_and_flat_config(two_runs):
    (wandb_file,) = (two_runs[0] / "wandb").glob("offline-run-*/run-*.wandb")
    run = wandb_run_record(wandb_file)
    assert run.display_name == "kl-small" and run.run_group == "tiny_klppo"  # grouped by recipe
    tags = list(run.tags)
    assert tags[0] == "recipe:tiny_klppo" and tags[-1].startswith("config:") and len(tags[-1]) == len("config:") + 8
    keys = {item.key for item in run.config.update}
    assert {KL_KEY, "actor_rollout_ref.actor.optim.lr", "trainer.recipe"} <= keys  # flattened: filterable
    assert run.run_id == (two_runs[0] / "wandb_run_id").read_text()
