"""W&B on compute nodes: offline chosen where there are no credentials or no service, said once,
with the command that uploads the run; one history row per logged step."""

from __future__ import annotations

import socket
import time

import pytest

from rlhf_hpc.observability.tracking import Tracker, wandb_mode
from rlhf_hpc.recipe.load import load_config
from tests.conftest import wandb_history_so_far


def netrc_file(tmp_path, host: str = "api.wandb.ai"):
    f = tmp_path / "netrc"
    f.write_text(f"machine {host} login user password 0123456789\n")
    f.chmod(0o600)
    return str(f)


def test_wandb_mode_is_offline_without_credentials(tmp_path):
    mode, why = wandb_mode({"HOME": str(tmp_path), "NETRC": str(tmp_path / "none")})
    assert mode == "offline" and why.startswith("no W&B credentials here (WANDB_API_KEY, or a ~/.netrc entry")
    assert wandb_mode({"WANDB_MODE": "disabled"}) == ("disabled", "WANDB_MODE is set")


def test_wandb_mode_is_offline_when_the_service_does_not_answer(tmp_path):
    with socket.socket() as s:  # a port nothing listens on once this closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"WANDB_API_KEY": "x" * 40, "WANDB_BASE_URL": f"http://127.0.0.1:{port}"}
    mode, why = wandb_mode(env)
    assert mode == "offline" and why.startswith("127.0.0.1 cannot be reached from here")
    with socket.socket() as server:  # credentials in a netrc, and a service that answers
        server.bind(("127.0.0.1", 0))
        server.listen()
        env = {
            "NETRC": netrc_file(tmp_path, "127.0.0.1"),
            "WANDB_BASE_URL": f"http://127.0.0.1:{server.getsockname()[1]}",
        }
        assert wandb_mode(env)[0] == "online"


@pytest.mark.slow
def test_tracker_goes_offline_by_itself_and_logs_each_row_once(tmp_path, monkeypatch, capsys):
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    cfg, _ = load_config("tiny_klppo", ["trainer.logger=[console,wandb]"])
    run = tmp_path / "run"
    tracker = Tracker(cfg, run, is_main=True, total_steps=3)
    for step in (1, 2, 3):
        tracker.log({"critic/score/mean": 0.1 * step, "timing_s/step": 1.0}, step)
    tracker.close()
    out = capsys.readouterr().out
    sync = f"wandb sync {run.resolve() / 'wandb'}/offline-run-*"
    assert out.count("[rlhf-hpc] W&B offline: no W&B credentials here") == 1 and sync in out
    assert f"[rlhf-hpc] W&B ran offline; upload the run with: {sync}" in out
    (wandb_file,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 60
    while len(history := wandb_history_so_far(wandb_file)) < 3 and time.monotonic() < deadline:
        time.sleep(0.5)  # W&B's service process writes the file after finish() returns
    assert [h["_step"] for h in history] == [1, 2, 3]  # one row per log() call
    assert [h["training/global_step"] for h in history] == [1, 2, 3]
    assert [h["critic/score/mean"] for h in history] == pytest.approx([0.1, 0.2, 0.3])


def test_the_console_line_shows_validation_scores_and_no_step_time_for_a_validation_row(tmp_path):
    cfg, _ = load_config("tiny_klppo", [f"trainer.default_local_dir={tmp_path}"])
    tracker = Tracker(cfg, tmp_path, True, 60)
    console = next(b for b in tracker.backends if b.name == "console")
    try:
        step = console.progress_line(
            {"critic/score/mean": 0.1, "timing_s/step": 0.3, "val-core/synthetic/copy/reward/mean@1": 0.25}, 20
        )
        assert step == "step 20/60 | score 0.1 | val synthetic/copy 0.25 | 0.30s/step  ETA 0m12s"
        # val_before_train: a row of validation scores only
        assert (
            console.progress_line({"val-core/openai/gsm8k/reward/mean@1": 0.5}, 0) == "step 0/60 | val openai/gsm8k 0.5"
        )
    finally:
        tracker.close()


def test_a_finished_run_ends_on_one_line_saying_where_it_is_and_what_comes_next(tmp_path):
    from rlhf_hpc.observability.run_summary import run_summary

    run = tmp_path / "run"
    last = {"critic/score/mean": 0.612, "actor/pg_loss": 0.1}
    val = {"val-core/synthetic/copy/reward/mean@1": 0.65, "val-aux/x/mean": 1.0}
    line = run_summary(60, 60, last, val, 3725.2, run, run / "global_step_60")
    assert "\n" not in line and line.startswith("[rlhf-hpc] done: 60/60 steps in 1h02m05s; last score 0.612 ")
    assert "validation val-core/synthetic/copy/reward/mean@1 0.65;" in line and "val-aux" not in line
    assert f"checkpoint {run}/global_step_60, metrics {run}/metrics.jsonl" in line
    assert f"python launch.py compare {run} OTHER_RUN_DIR --out DIR" in line
    assert f"python launch.py export {run}/global_step_60 --out DIR" in line and "resumes from it" in line
    # nothing saved, no validation: it says so instead of pointing at nothing
    bare = run_summary(4, 4, {}, {}, 42.0, run, None)
    assert bare.startswith("[rlhf-hpc] done: 4/4 steps in 42s; metrics ") and "launch.py export" not in bare
    assert "no checkpoint to export or resume from (trainer.save_freq)" in bare and "validation" not in bare
