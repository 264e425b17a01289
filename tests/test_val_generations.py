"""``trainer.log_val_generations`` (verl's N validation generations per evaluation: the rows verl
picks, gathered from the ranks that generated them, in ``val_generations.jsonl`` and each tracker's
table) and ``trainer.val_only`` (verl's evaluation run)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.data.dataset import load_examples
from rlhf_hpc.distributed.process_group import DistContext
from rlhf_hpc.models.tokenizer import load_tokenizer, tokenizer_path
from rlhf_hpc.observability.tracking import VAL_GENERATIONS_FILE, Tracker
from rlhf_hpc.ppo import validation
from rlhf_hpc.ppo.validation import run_validation, select_val_generations
from rlhf_hpc.recipe.load import load_config
from rlhf_hpc.rewards import RewardFunction
from rlhf_hpc.rollout.base import Response
from tests.conftest import wandb_history_so_far


def verl_pick(inputs, outputs, scores, n):
    """verl b178a3c's ``RayPPOTrainer._maybe_log_val_generations``, as written there."""
    import numpy as np

    samples = list(zip(inputs, outputs, scores, strict=True))
    samples.sort(key=lambda x: x[0])
    rng = np.random.RandomState(42)
    rng.shuffle(samples)
    return samples[:n]


@pytest.mark.parametrize("n", [1, 3])
def test_the_rows_are_the_ones_verl_picks(n):
    prompts = [f"prompt {c}" for c in "qwertyuiopasdfgq"]  # (one prompt twice: the sort is stable)
    # verl's lists: each prompt repeated n times next to each other (repeat(interleave=True))
    inputs = [p for p in prompts for _ in range(n)]
    outputs = [f"{p} / response {j}" for p in prompts for j in range(n)]
    scores = [float(i) for i in range(len(inputs))]
    for count in (1, 5, len(inputs), len(inputs) + 4):
        ours = [
            (prompts[i], f"{prompts[i]} / response {j}", float(i * n + j))
            for i, j in select_val_generations(prompts, n, count)
        ]
        assert ours == verl_pick(inputs, outputs, scores, count)


class FakeRollout:
    """An engine answering each prompt with its own last tokens (response j: shifted by j)."""

    dp_rank = 0

    def resume(self):
        pass

    def release(self):
        pass

    def generate(self, prompts, sampling):
        return [
            [
                Response(token_ids=p[-4 + j : len(p) - j] or p[-1:], logprobs=[], finish_reason="stop")
                for j in range(sampling.n)
            ]
            for p in prompts
        ]


def validation_inputs(monkeypatch, *overrides):
    cfg, _ = load_config("tiny_klppo", ["trainer.log_val_generations=6", *overrides])
    tokenizer = load_tokenizer(tokenizer_path(cfg), False, None)
    val = load_examples(cfg.data.val_files, tokenizer, cfg.data, split_seed=cfg.data.seed + 1)
    monkeypatch.setattr(validation, "sync_weights_to_rollout", lambda *a, **k: None)
    models = SimpleNamespace(actor=SimpleNamespace(model=None))
    return cfg, tokenizer, val, models, RewardFunction(cfg.custom_reward_function)


def ctx(rank, world):
    return DistContext(rank, world, rank, torch.device("cpu"), "gloo")


def test_run_validation_keeps_the_picked_rows_from_every_rank(monkeypatch):
    cfg, tokenizer, val, models, reward_fn = validation_inputs(monkeypatch, "data.val_batch_size=24")
    one: list[dict] = []
    metrics = run_validation(cfg, ctx(0, 1), models, FakeRollout(), val, tokenizer, reward_fn, generations=one)
    assert list(metrics) == [f"val-core/{val[0].data_source}/reward/mean@1"]
    inputs = [tokenizer.decode(e.prompt_ids, skip_special_tokens=True) for e in val]
    picked = select_val_generations(inputs, 1, 6)
    assert [r["input"] for r in one] == [inputs[i] for i, _ in picked] and len(one) == 6
    for r in one:
        assert set(r) == {"input", "output", "score", "data_source"} and r["data_source"] == val[0].data_source
        assert isinstance(r["score"], float) and isinstance(r["output"], str)
    # two ranks (each generating half of each 24-prompt chunk): rank 0 gets the same rows, in the same order
    kept_by_rank1 = {}
    monkeypatch.setattr(validation, "_gather_to_all", lambda kept: kept_by_rank1.update(kept) or {})
    rank1: list[dict] = []
    run_validation(cfg, ctx(1, 2), models, FakeRollout(), val, tokenizer, reward_fn, generations=rank1)
    assert rank1 == [] and 0 < len(kept_by_rank1) < 6
    monkeypatch.setattr(validation, "_gather_to_all", lambda kept: {**kept, **kept_by_rank1})
    rank0: list[dict] = []
    run_validation(cfg, ctx(0, 2), models, FakeRollout(), val, tokenizer, reward_fn, generations=rank0)
    assert rank0 == one


def test_nothing_is_kept_at_the_default(monkeypatch):
    cfg, tokenizer, val, models, reward_fn = validation_inputs(monkeypatch, "trainer.log_val_generations=0")
    monkeypatch.setattr(validation, "_gather_to_all", lambda kept: pytest.fail("no gather at the default"))
    rows: list[dict] = []
    run_validation(cfg, ctx(0, 1), models, FakeRollout(), val, tokenizer, reward_fn, generations=rows)
    assert rows == []


def test_val_kwargs_n_rows_are_responses(monkeypatch):
    cfg, tokenizer, val, models, reward_fn = validation_inputs(
        monkeypatch,
        "actor_rollout_ref.rollout.val_kwargs.n=2",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
    )
    rows: list[dict] = []
    metrics = run_validation(cfg, ctx(0, 1), models, FakeRollout(), val, tokenizer, reward_fn, generations=rows)
    assert f"val-core/{val[0].data_source}/reward/mean@2" in metrics
    inputs = [tokenizer.decode(e.prompt_ids, skip_special_tokens=True) for e in val]
    picked = select_val_generations(inputs, 2, 6)
    assert [(r["input"], r["output"]) for r in rows] == [
        (
            inputs[i],
            tokenizer.decode(
                FakeRollout().generate([val[i].prompt_ids], SimpleNamespace(n=2))[0][j].token_ids,
                skip_special_tokens=True,
            ),
        )
        for i, j in picked
    ]


ROWS = [
    {"input": "copy: abc", "output": "abc", "score": 1.0, "data_source": "synthetic/copy"},
    {"input": "copy: xyz", "output": "xy", "score": 0.0, "data_source": "synthetic/copy"},
]


@pytest.mark.slow
def test_the_tracker_writes_the_rows_and_each_backend_its_table(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg, _ = load_config(
        "tiny_klppo", ["trainer.logger=[console,wandb,tensorboard,mlflow]", "trainer.log_val_generations=2"]
    )
    run = tmp_path / "run"
    tracker = Tracker(cfg, run, is_main=True, total_steps=4)
    for step in (0, 2):  # (a validation before training, and one at step 2)
        tracker.log_generations(ROWS, step)
        tracker.log({"val-core/synthetic/copy/reward/mean@1": 0.5}, step)
    tracker.close()
    assert f"[rlhf-hpc] step 2: 2 validation generations in {run / VAL_GENERATIONS_FILE}" in capsys.readouterr().out
    lines = [json.loads(x) for x in (run / VAL_GENERATIONS_FILE).read_text().splitlines()]
    assert lines == [{"step": s, **r} for s in (0, 2) for r in ROWS]
    # W&B: verl's table (a row per validation: step, input_1, output_1, score_1, ...), all rows so far
    deadline = time.monotonic() + 60
    while (
        not (
            tables := sorted(
                run.glob("wandb/offline-run-*/files/media/table/val/generations_*.table.json"),
                key=lambda p: p.stat().st_mtime,
            )
        )
        and time.monotonic() < deadline
    ):
        time.sleep(0.5)
    assert tables
    table = max((json.loads(p.read_text()) for p in tables), key=lambda t: len(t["data"]))
    assert table["columns"] == ["step", "input_1", "output_1", "score_1", "input_2", "output_2", "score_2"]
    assert table["data"] == [[s, "copy: abc", "abc", 1.0, "copy: xyz", "xy", 0.0] for s in (0, 2)]
    # ... in the validation's own row (one row per log() call, none more)
    (wandb_file,) = run.glob("wandb/offline-run-*/run-*.wandb")
    while len(history := wandb_history_so_far(wandb_file)) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [h["_step"] for h in history] == [1, 2]
    assert [(h["val/generations/_type"], h["val/generations/nrows"]) for h in history] == [
        ("table-file", 1),
        ("table-file", 2),
    ]
    assert [h["training/global_step"] for h in history] == [0, 2]
    # MLflow: verl's artifact val_step<step>.json
    (art,) = run.glob("mlruns/*/*/artifacts/val_step2.json")
    assert json.loads(art.read_text()) == [{k: r[k] for k in ("input", "output", "score")} for r in ROWS]
    # TensorBoard: verl's text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = acc.Tensors("val/generations/text_summary")  # (add_text's tag)
    assert [t.step for t in texts] == [1, 2]  # the rows of the validations' metrics (the row counter)
    text = texts[-1].tensor_proto.string_val[0].decode()
    assert text.startswith("**Generation Results - Step 2**") and "**Output:** xy" in text


def test_the_keys_are_accepted_and_checked(tmp_path):
    from tests.test_verl_parity import VERL_GRPO, verl_args

    cfg, _ = load_config(
        None,
        verl_args(VERL_GRPO, str(tmp_path)) + ["trainer.log_val_generations=10", "trainer.val_only=True"],
        check_files=False,
    )
    assert cfg.trainer.log_val_generations == 10 and cfg.trainer.val_only
    with pytest.raises(ConfigError, match=r"trainer.log_val_generations=-1: the number of validation generations"):
        load_config("tiny_klppo", ["trainer.log_val_generations=-1"], check_files=False)
    with pytest.raises(ConfigError, match=r"trainer.val_only=true: an evaluation run needs a validation set"):
        load_config("tiny_klppo", ["trainer.val_only=true", "data.val_files=null"], check_files=False)


def _launch(run, *extra):
    from tests.conftest import run_launch

    out = run_launch(
        "recipe=tiny_klppo",
        f"trainer.default_local_dir={run}",
        "trainer.logger=[console,wandb]",
        "trainer.log_val_generations=3",
        "actor_rollout_ref.rollout.name=hf",
        *extra,
        env={"WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out


@pytest.mark.slow
def test_a_run_logs_its_generations_and_val_only_evaluates_its_checkpoint(tmp_path):
    """Two training steps validated before training and at step 2 (3 generations each), then
    ``trainer.val_only=true`` on the same run directory: it resumes the step-2 checkpoint, adds one
    validation row at step 2 with the same generations (greedy, same weights), trains nothing and
    writes no checkpoint."""
    from rlhf_hpc.ppo.checkpoint import list_checkpoints

    run = tmp_path / "run"
    _launch(
        run,
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "trainer.save_freq=2",
        "trainer.val_before_train=true",
    )
    gens = [json.loads(x) for x in (run / VAL_GENERATIONS_FILE).read_text().splitlines()]
    assert [g["step"] for g in gens] == [0, 0, 0, 2, 2, 2]
    assert [g["input"] for g in gens[3:]] == [g["input"] for g in gens[:3]]  # (the same prompts each time)
    assert list(run.glob("wandb/offline-run-*/files/media/table/val/generations_*.table.json"))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    checkpoints = list_checkpoints(run)

    out = _launch(run, "trainer.val_only=true", "trainer.total_training_steps=2")
    assert "[rlhf-hpc] trainer.val_only: validated at step 2; no training" in out.stdout
    assert list_checkpoints(run) == checkpoints
    after = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert after[: len(rows)] == rows and len(after) == len(rows) + 1
    (val,) = after[len(rows) :]
    assert val["training/global_step"] == 2 and not any(k.startswith(("actor/", "critic/", "timing_s/")) for k in val)
    assert val["val-core/synthetic/copy/reward/mean@1"] == rows[-1]["val-core/synthetic/copy/reward/mean@1"]
    again = [json.loads(x) for x in (run / VAL_GENERATIONS_FILE).read_text().splitlines()]
    assert again[:6] == gens and again[6:] == gens[3:]
