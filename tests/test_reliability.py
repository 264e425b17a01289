"""Reliability: the stability guard, damaged checkpoints, resume safety, faults in real processes."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import pickle
import re
from pathlib import Path

import pytest
import torch

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.schema import GuardConfig
from rlhf_hpc.config.tree import dump_yaml, get_key, to_dict
from rlhf_hpc.observability.tracking import read_metrics
from rlhf_hpc.ppo import checkpoint as ckpt
from rlhf_hpc.ppo.checkpoint import RESUME_KEYS, check_resume_compatible
from rlhf_hpc.ppo.guard import StabilityGuard
from rlhf_hpc.recipe.load import load_config
from tests.conftest import run_launch, wandb_history

# what may differ between two runs of the same steps (a restarted run repeats steps: log_step)
NONDETERMINISTIC = ("timing_s/", "perf/", "memory_gb/", "training/log_step")


# ------------------------------------------------------------------------------------- guard
def test_guard_checks():
    g = StabilityGuard(GuardConfig(max_kl=0.1, kl_rise_threshold=0.05, kl_rise_steps=2, vf_jump_factor=10, window=3))
    assert g.check({"actor/pg_loss": 0.1, "actor/ref_kl_mean": 0.01, "critic/vf_loss": 1.0}) is None
    assert g.check({"actor/pg_loss": math.nan}) == "actor/pg_loss is nan"
    assert g.check({"actor/grad_norm_nonfinite": 1.0}).startswith("non-finite actor gradient")
    assert g.check({"actor/ref_kl_mean": 0.5}) == "KL(actor || reference) 0.5 > trainer.guard.max_kl=0.1"
    g2 = StabilityGuard(GuardConfig(kl_rise_threshold=0.05, kl_rise_steps=2))
    assert g2.check({"actor/ref_kl_mean": 0.06}) is None
    assert g2.check({"actor/ref_kl_mean": 0.07}).startswith("KL 0.07 above trainer.guard.kl_rise_threshold=0.05 for 2")
    g3 = StabilityGuard(GuardConfig(vf_jump_factor=10, window=3))
    for v in (1.0, 2.0, 1.5):
        assert g3.check({"critic/vf_loss": v}) is None
    assert g3.check({"critic/vf_loss": 16.0}).startswith(
        "critic/vf_loss 16 > 10 x the median of the last 3 steps (1.5)"
    )


def test_guard_ignores_a_small_noisy_value_loss_and_catches_a_blow_up():
    # the CPU demo's false alarm: vf_loss 0.0012 for a while, then 0.014 with returns in [0, 1]
    demo = {"critic/returns/max": 1.0, "critic/returns/min": 0.0}
    g = StabilityGuard(GuardConfig())
    for v in (0.0011, 0.0012, 0.0013, 0.0012, 0.0010, 0.0012):
        assert g.check({**demo, "critic/vf_loss": v}) is None
    assert g.check({**demo, "critic/vf_loss": 0.014}) is None
    # a critic gone wrong: worse than predicting 0 on every token, and 10x its recent median
    reason = g.check({**demo, "critic/vf_loss": 3.0})
    assert (
        reason.startswith("critic/vf_loss 3 > 10.0 x the median of the last 5 steps (0.0012)")
        and "> 0.5, the loss" in reason
    )
    # returns of a larger scale raise the floor with them
    big = {"critic/returns/max": 20.0, "critic/returns/min": -4.0}
    g = StabilityGuard(GuardConfig())
    for v in (1.0, 1.2, 0.9, 1.1, 1.0):
        assert g.check({**big, "critic/vf_loss": v}) is None
    assert g.check({**big, "critic/vf_loss": 150.0}) is None  # < 0.5 x 20^2
    assert g.check({**big, "critic/vf_loss": 250.0}) is not None


# a healthy real run (BENCHMARKS.md "A real model learns": SmolLM2-135M, GRPO, 40 steps): the policy
# sharpens (entropy 2.27 -> 0.28) and moves away from the reference (KL 0 -> 0.31) over many steps
HEALTHY_ENTROPY = [
    2.266,
    2.168,
    2.226,
    2.156,
    2.036,
    2.105,
    2.112,
    2.04,
    2.096,
    1.985,
    2.28,
    2.042,
    1.967,
    2.134,
    1.83,
    1.922,
    1.875,
    1.738,
    1.717,
    1.649,
    1.674,
    1.615,
    1.23,
    1.415,
    1.245,
    1.011,
    1.17,
    1.05,
    0.966,
    0.857,
    0.837,
    0.59,
    0.717,
    0.535,
    0.547,
    0.416,
    0.413,
    0.344,
    0.58,
    0.277,
]
HEALTHY_KL = [
    0.0,
    0.002,
    0.001,
    -0.0,
    0.003,
    -0.0,
    0.003,
    0.001,
    0.001,
    0.006,
    0.002,
    0.011,
    0.013,
    0.004,
    0.017,
    0.022,
    0.019,
    0.029,
    0.029,
    0.067,
    0.059,
    0.071,
    0.12,
    0.073,
    0.101,
    0.143,
    0.147,
    0.16,
    0.159,
    0.203,
    0.21,
    0.261,
    0.216,
    0.282,
    0.266,
    0.345,
    0.278,
    0.336,
    0.282,
    0.309,
]


def test_guard_catches_a_collapse_against_the_runs_own_level():
    """The demo at LR 10: entropy 4.14 -> 0.0 and KL 0 -> 4.2 in one step. Both scale-free checks
    see it; a healthy run's gradual sharpening and drift trips neither. They judge the rollouts,
    i.e. the previous update: lag 1 (the checkpoint saved after it is not rolled back to)."""
    g = StabilityGuard(GuardConfig())
    assert g.check({"actor/entropy": 4.14, "actor/ref_kl_mean": 0.0}) is None and g.lag == 0
    reason = g.check({"actor/entropy": 0.0, "actor/ref_kl_mean": 4.2})
    assert (
        reason
        == (
            "actor/entropy 0 < trainer.guard.entropy_drop=0.2 x its median over the last 1 steps (4.14): "
            "the policy collapsed"
        )
        and g.lag == 1
    )
    g = StabilityGuard(GuardConfig(entropy_drop=None))
    g.check({"actor/entropy": 4.14, "actor/ref_kl_mean": 0.0})
    assert g.check({"actor/entropy": 0.0, "actor/ref_kl_mean": 4.2}).startswith(
        "KL(actor || reference) 4.2 jumped past trainer.guard.kl_jump_factor=3.0 x its median over the last 1 steps (0)"
    )
    healthy = StabilityGuard(GuardConfig())
    for entropy, kl in zip(HEALTHY_ENTROPY, HEALTHY_KL):
        assert healthy.check({"actor/entropy": entropy, "actor/ref_kl_mean": kl}) is None, (entropy, kl)
    # a loss check judges this step's own update: lag 0
    assert healthy.check({"actor/pg_loss": math.nan}) == "actor/pg_loss is nan" and healthy.lag == 0


def test_guard_trips_scale_and_stop():
    g = StabilityGuard(GuardConfig(lr_decay=0.5, kl_coef_mult=2.0, max_rollbacks=2))
    assert g.trip("x") == "stability guard tripped: x; rolling back (#1), actor LR x0.5, KL coefficient x2"
    g.trip("y")
    assert (g.lr_scale, g.kl_scale) == (0.25, 4.0)
    with pytest.raises(RuntimeError, match=r"stability guard: z; stopping after 2 rollbacks"):
        g.trip("z")
    g2 = StabilityGuard(GuardConfig())
    g2.load_state_dict(g.state_dict())
    assert g2.state_dict() == g.state_dict()


# ------------------------------------------------------------------------------- checkpoints
def _save(root: Path, step: int, model: torch.nn.Module) -> Path:
    return ckpt.save_checkpoint(
        root, step, {"actor": (model, torch.optim.AdamW(model.parameters()))}, extra={"global_step": step}
    )


def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path):
    model = torch.nn.Linear(64, 64)
    _save(tmp_path, 1, model)
    newest = _save(tmp_path, 2, model)
    assert ckpt.choose_resume(tmp_path) == newest
    shard = max((newest / "actor").glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a truncated shard
    said = []
    assert ckpt.choose_resume(tmp_path, said.append) == tmp_path / "global_step_1"
    assert len(said) == 1 and said[0].startswith(f"[rlhf-hpc] checkpoint {newest} is damaged (actor/{shard.name} has ")
    assert said[0].endswith("were written); falling back to the previous one")


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 64)
    return model, torch.optim.AdamW(model.parameters())


def test_same_size_damage_is_found_by_its_checksum_and_the_previous_checkpoint_is_loaded(tmp_path):
    """actor/.metadata overwritten with random bytes of its own length: the sizes match, the
    SHA-256 does not; the resume loads step 1 and says which file was damaged."""
    model, optimizer = _model_and_optimizer(0)
    first = _save(tmp_path, 1, model)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    newest = _save(tmp_path, 2, model)
    manifest = json.loads((newest / ckpt.COMPLETE).read_text())
    assert (
        manifest["sha256"]["actor/.metadata"] == hashlib.sha256((newest / "actor/.metadata").read_bytes()).hexdigest()
    )
    assert sorted(manifest["sha256"]) == sorted(manifest["files"])  # every file, as sha256sum computes it
    meta = newest / "actor" / ".metadata"
    meta.write_bytes(os.urandom(meta.stat().st_size))
    said = []
    assert ckpt.choose_resume(tmp_path, said.append) == first
    assert said == [
        f"[rlhf-hpc] checkpoint {newest} is damaged (actor/.metadata does not match its sha256 checksum "
        f"(same size, other content)); falling back to the previous one"
    ]
    assert ckpt.choose_resume(tmp_path, content=False) == newest  # the launcher's quick look: sizes only
    cfg, _ = load_config("tiny_klppo", [f"trainer.default_local_dir={tmp_path}"], check_files=False)
    fresh, fresh_optimizer = _model_and_optimizer(1)
    applied = []
    path, extra = ckpt.resume(
        cfg, tmp_path, {"actor": (fresh, fresh_optimizer)}, log=lambda *_: None, apply=applied.append
    )
    assert path == first and extra == {"global_step": 1} and applied == [extra]
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())


def _without_checksums(path: Path) -> None:
    """``path``'s manifest as checkpoints wrote it before checksums: sizes only."""
    meta = json.loads((path / ckpt.COMPLETE).read_text())
    del meta["sha256"]
    (path / ckpt.COMPLETE).write_text(json.dumps(meta))


def test_a_checkpoint_without_checksums_resumes_and_one_that_does_not_load_falls_back(tmp_path):
    """A manifest of sizes (written before checksums) still resumes; damage it cannot see makes the
    load fail, and the resume goes to the previous checkpoint, naming the part that failed."""
    model, optimizer = _model_and_optimizer(0)
    first, newest = _save(tmp_path, 1, model), _save(tmp_path, 2, model)
    for path in (first, newest):
        _without_checksums(path)
    cfg, _ = load_config("tiny_klppo", [f"trainer.default_local_dir={tmp_path}"], check_files=False)
    assert ckpt.resume(cfg, tmp_path, {"actor": _model_and_optimizer(1)})[0] == newest
    meta = newest / "actor" / ".metadata"
    meta.write_bytes(os.urandom(meta.stat().st_size))
    assert ckpt.verify_checkpoint(newest) is None  # the sizes match
    said = []
    path, extra = ckpt.resume(cfg, tmp_path, {"actor": _model_and_optimizer(1)}, said.append)
    assert (path, extra) == (first, {"global_step": 1})
    assert len(said) == 1 and said[0].startswith(f"[rlhf-hpc] checkpoint {newest} is damaged (loading failed: actor: ")
    assert "metadata read failed" in said[0] and said[0].endswith("; falling back to the previous one")
    # nothing loads: an error, not a fresh start from half-loaded models
    extra_file = first / "extra.pt"
    extra_file.write_bytes(os.urandom(extra_file.stat().st_size))
    with pytest.raises(RuntimeError, match=f"no checkpoint under {tmp_path} loads .the last tried: {first}."):
        ckpt.resume(cfg, tmp_path, {"actor": _model_and_optimizer(1)}, log=lambda *_: None)


def test_save_contents_choose_what_a_checkpoint_holds_and_a_resume_says_what_it_lacks(tmp_path):
    """verl's checkpoint.save_contents / load_contents: a model-only checkpoint loads the model and
    says that the optimizer and the schedule start fresh; an hf_model-only one (verl's GMPO line)
    holds a Hugging Face model transformers loads, and a resume passes over it, saying why."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from rlhf_hpc.models.hf import build_causal_lm

    model, optimizer = _model_and_optimizer(0)
    optimizer.zero_grad()
    model(torch.ones(1, 64)).sum().backward()
    optimizer.step()  # (an optimizer with state to leave out)
    full = ckpt.save_checkpoint(tmp_path, 1, {"actor": (model, optimizer)}, {"global_step": 1})
    only_model = ckpt.save_checkpoint(
        tmp_path, 2, {"actor": (model, optimizer)}, {"global_step": 2}, contents={"actor": {"model"}}
    )
    assert ckpt.saved_contents(full) == {"actor": {"model", "optimizer", "extra"}}
    assert ckpt.saved_contents(only_model) == {"actor": {"model"}} and not (only_model / "rng").exists()
    assert (
        sum(f.stat().st_size for f in (only_model / "actor").iterdir())
        < sum(f.stat().st_size for f in (full / "actor").iterdir()) / 2
    )  # no Adam moments
    cfg, _ = load_config("tiny_klppo", [f"trainer.default_local_dir={tmp_path}"], check_files=False)
    fresh, fresh_optimizer = _model_and_optimizer(1)
    said = []
    path, extra = ckpt.resume(cfg, tmp_path, {"actor": (fresh, fresh_optimizer)}, said.append)
    assert path == only_model and extra == {"global_step": 2}
    assert torch.equal(fresh.weight, model.weight) and not fresh_optimizer.state  # the model; a fresh optimizer
    assert said == [
        f"[rlhf-hpc] {only_model}: the actor's checkpoint holds no optimizer state (the optimizer starts "
        f"fresh): it was saved with actor.checkpoint.save_contents=['model']",
        f"[rlhf-hpc] {only_model}: the actor's checkpoint holds no LR schedule or RNG states (the schedule "
        f"starts over; the RNG is seeded anew): it was saved with actor.checkpoint.save_contents=['model']",
    ]
    # load_contents without the optimizer: none loaded, nothing said
    fresh, fresh_optimizer = _model_and_optimizer(1)
    said = []
    ckpt.resume(cfg, tmp_path, {"actor": (fresh, fresh_optimizer)}, said.append, load={"actor": {"model"}})
    assert said == [] and not fresh_optimizer.state
    # hf_model alone: a Hugging Face model, no shards; passed over by a resume, refused by name
    lm = build_causal_lm("tiny://qwen2", torch.float32, "cpu", seed=0)
    mcfg = SimpleNamespace(path="tiny://qwen2", override_config={}, trust_remote_code=False, tokenizer_path=None)
    hf_only = ckpt.save_checkpoint(
        tmp_path / "lm",
        3,
        {"actor": (lm, torch.optim.AdamW(lm.parameters()))},
        {"global_step": 3},
        contents={"actor": {"hf_model"}},
        hf_writer=lambda name, m, out: ckpt.save_hf_model(m, mcfg, out, "float32"),
    )
    assert sorted(p.name for p in (hf_only / "actor").iterdir()) == [ckpt.HF_DIR]
    back = AutoModelForCausalLM.from_pretrained(hf_only / "actor" / ckpt.HF_DIR)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in lm.state_dict().items())
    assert ckpt.verify_checkpoint(hf_only) is None
    why = ckpt.model_missing(hf_only, None)
    assert why == (
        f"its actor holds no model shards (saved with save_contents=['hf_model']), so no run can continue "
        f"from it; its Hugging Face model {hf_only / 'actor' / ckpt.HF_DIR} can start a new run (model.path)"
    )
    cfg, _ = load_config("tiny_klppo", [f"trainer.resume_mode={hf_only}"], check_files=False)
    with pytest.raises(RuntimeError, match="holds no model shards"):
        ckpt.resume(cfg, tmp_path / "lm", {"actor": (lm, None)})
    export = ckpt.export_hf(hf_only, tmp_path / "export")  # (its Hugging Face model is the export)
    assert (export / "model.safetensors").is_file()


def test_checkpoint_contents_are_verls_and_checked_at_the_dry_run():
    key = "actor_rollout_ref.actor.checkpoint"
    cfg, warnings = load_config(
        "tiny_klppo", [f"{key}.save_contents=['hf_model']", "trainer.save_freq=10"], check_files=False
    )
    assert cfg.actor_rollout_ref.actor.checkpoint.save_contents == ["hf_model"]
    assert any("writes no model and no optimizer state: the stability guard cannot roll back" in w for w in warnings)
    for extra, message in (
        ([f"{key}.save_contents=[model,weights]"], "each entry one of model, optimizer, extra, hf_model"),
        ([f"{key}.load_contents=[optimizer]"], "a resume that loads no model is a new run"),
        (["critic.checkpoint.save_contents=[model,hf_model]"], "hf_model is written for the actor only"),
        ([f"{key}.save_contents=[model,hf_model]", "actor_rollout_ref.model.lora_rank=8"], "hf_model with LoRA"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config("tiny_klppo", extra, check_files=False)


@pytest.mark.slow
def test_the_trainer_writes_what_save_contents_names_and_resumes_saying_what_is_missing(tmp_path):
    """tiny_klppo on 2 ranks: the actor's checkpoints with hf_model (a Hugging Face model equal to the
    export of the same checkpoint), the critic's with its model only; a resume from step 1 loads the
    models and, where the resumed run's critic asks for them (its default load_contents), says that
    the critic's optimizer and schedule start fresh."""
    from transformers import AutoModelForCausalLM

    common = [
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        "critic.checkpoint.save_contents=[model]",
    ]
    train(tmp_path / "run", *common, "trainer.total_training_steps=2", "trainer.save_freq=1")
    step1 = tmp_path / "run" / "global_step_1"
    assert ckpt.saved_contents(step1) == {"actor": {"model", "optimizer", "extra", "hf_model"}, "critic": {"model"}}
    ours = AutoModelForCausalLM.from_pretrained(step1 / "actor" / ckpt.HF_DIR)
    exported = AutoModelForCausalLM.from_pretrained(ckpt.export_hf(step1, tmp_path / "export", dtype="float32"))
    assert all(torch.equal(v, exported.state_dict()[k]) for k, v in ours.state_dict().items())
    out = train(tmp_path / "resumed", common[0], "trainer.total_training_steps=2", f"trainer.resume_mode={step1}")
    said = [line for line in (out.stdout + out.stderr).splitlines() if "holds no" in line]
    assert len(said) == 2 and all("the critic's checkpoint holds no" in line for line in said), (
        out.stdout[-3000:] + out.stderr[-3000:]
    )


def test_checkpoint_state_is_loaded_without_arbitrary_code(tmp_path):
    model = torch.nn.Linear(4, 4)
    path = _save(tmp_path, 1, model)

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    with open(path / "extra.pt", "wb") as f:
        pickle.dump({"global_step": Payload()}, f)
    with pytest.raises(ckpt.CheckpointLoadError, match="^extra.pt / rng: UnpicklingError") as e:
        ckpt.load_checkpoint(path, {"actor": (model, None)})
    assert isinstance(e.value.__cause__, pickle.UnpicklingError)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.slow
def test_resume_refuses_a_checkpoint_of_another_run(tmp_path):
    run = tmp_path / "run"
    cfg, _ = load_config("tiny_klppo", [f"trainer.default_local_dir={run}"])
    from rlhf_hpc.config.tree import dump_yaml, to_dict

    model = torch.nn.Linear(4, 4)
    ckpt.save_checkpoint(run, 2, {"actor": (model, None)}, {"global_step": 2}, config_text=dump_yaml(to_dict(cfg)))
    other, _ = load_config(
        "tiny_klppo",
        [
            f"trainer.default_local_dir={run}",
            "data.max_response_length=12",
            "actor_rollout_ref.model.path=tiny://qwen2?vocab_size=64&hidden_size=256",
            "actor_rollout_ref.actor.optim.lr=1e-4",
        ],
    )  # lr may change
    assert ckpt.incompatible_keys(dump_yaml(to_dict(cfg)), other) == [
        "actor_rollout_ref.model.path: tiny://qwen2?vocab_size=64 -> tiny://qwen2?vocab_size=64&hidden_size=256",
        "data.max_response_length: 8 -> 12",
        "critic.model.path: tiny://qwen2?vocab_size=64 -> tiny://qwen2?vocab_size=64&hidden_size=256",
    ]
    out = run_launch("recipe=tiny_klppo", f"trainer.default_local_dir={run}", "data.max_response_length=12")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"cannot resume from {run}/global_step_2: the run's config changed in keys that define it" in out.stderr
    assert "data.max_response_length: 8 -> 12" in out.stderr


@pytest.mark.slow
def test_unwritable_or_full_run_directory_is_refused_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    out = run_launch("recipe=tiny_klppo", f"trainer.default_local_dir={blocker}/run")
    assert out.returncode == 2 and f"trainer.default_local_dir: cannot write to '{blocker}/run'" in out.stderr
    out = run_launch("recipe=tiny_klppo", f"trainer.default_local_dir={tmp_path}/run", "trainer.min_free_disk_gb=1e9")
    assert out.returncode == 2 and "less than trainer.min_free_disk_gb=1000000000.0" in out.stderr


# ------------------------------------------------------------------------ faults, real processes
FAST = [
    "recipe=tiny_klppo",
    "actor_rollout_ref.rollout.name=hf",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
    "trainer.save_freq=2",
]


def train(run: Path, *extra: str, ok: bool = True, env: dict | None = None):
    out = run_launch(*FAST, f"trainer.default_local_dir={run}", *extra, timeout=600, env=env)
    if ok:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    return out


def same_steps(a: Path, b: Path, steps) -> None:
    ra = {r["training/global_step"]: r for r in read_metrics(a)}
    rb = {r["training/global_step"]: r for r in read_metrics(b)}
    for s in steps:
        da = {k: v for k, v in ra[s].items() if not k.startswith(NONDETERMINISTIC)}
        db = {k: v for k, v in rb[s].items() if not k.startswith(NONDETERMINISTIC)}
        assert da == db, (s, {k: (da[k], db.get(k)) for k in da if da[k] != db.get(k)})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run = tmp_path_factory.mktemp("whole") / "run"
    train(run, "trainer.total_training_steps=8")
    return run


RESTARTS = ("launcher.max_restarts=1",)


@pytest.mark.slow
def test_killed_worker_is_restarted_and_resumes_like_an_uninterrupted_run(tmp_path, uninterrupted):
    run = tmp_path / "run"
    out = train(run, "trainer.total_training_steps=8", *RESTARTS, "trainer.inject_fault=kill@5:1")
    assert "[rlhf-hpc] workers failed (exit 4: lost rank): rank 1 on " in out.stdout
    assert "; restart 1/1 from the latest checkpoint (last checkpoint " in out.stdout
    assert f"resumed from {run}/global_step_4 (step 4)" in out.stdout
    same_steps(uninterrupted, run, range(5, 9))


@pytest.mark.slow
def test_kill_during_checkpoint_write_resumes_the_previous_checkpoint(tmp_path, uninterrupted):
    run = tmp_path / "run"
    out = train(run, "trainer.total_training_steps=6", *RESTARTS, "trainer.inject_fault=kill_in_save@4:0")
    assert f"resumed from {run}/global_step_2 (step 2)" in out.stdout
    same_steps(uninterrupted, run, range(3, 7))


@pytest.mark.slow
def test_damaged_checkpoints_are_skipped_on_resume_by_every_rank(tmp_path, uninterrupted):
    """Two ranks. Step 8: actor/.metadata overwritten with random bytes of its own length (its
    checksum says so). Step 6: a manifest of sizes only (a checkpoint from before checksums) and
    rank 1's RNG file damaged the same way: rank 1 alone fails to load it, and both ranks go on to
    step 4 together. From there the run repeats the uninterrupted run's steps exactly."""
    run = tmp_path / "run"
    import shutil

    shutil.copytree(uninterrupted, run)
    for damaged in (run / "global_step_8" / "actor" / ".metadata", run / "global_step_6" / "rng" / "rank_1.pt"):
        damaged.write_bytes(os.urandom(damaged.stat().st_size))
    _without_checksums(run / "global_step_6")
    out = train(run, "trainer.total_training_steps=6")
    assert (
        f"checkpoint {run}/global_step_8 is damaged (actor/.metadata does not match its sha256 checksum (same "
        f"size, other content)); falling back to the previous one"
    ) in out.stdout
    # (random bytes fail torch.load with UnpicklingError ~93% of the time, else IndexError, UnicodeDecodeError
    # or KeyError: whichever, rank 1 alone names it)
    assert re.search(
        rf"checkpoint {re.escape(str(run))}/global_step_6 is damaged \(loading failed: extra.pt / rng: "
        rf"rank 1: [A-Za-z_.]*(Error|Exception): ",
        out.stdout,
    ), out.stdout[-3000:]
    assert f"resumed from {run}/global_step_4 (step 4)" in out.stdout and "Traceback" not in out.stdout + out.stderr
    same_steps(uninterrupted, run, (5, 6))


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault,trip_step,expect",
    [
        ("nan_grad@3", 3, "actor/pg_loss is nan"),
        # the LR x1000 update of step 3 shows as KL on step 4's rollouts
        ("lr_x1000@3", 4, "KL(actor || reference)"),
    ],
)
def test_guard_rolls_back_a_divergent_step_and_the_run_finishes(tmp_path, fault, trip_step, expect):
    run = tmp_path / "run"
    out = train(
        run,
        "trainer.total_training_steps=6",
        f"trainer.inject_fault={fault}",
        "trainer.guard.max_kl=0.5",
        "algorithm.use_kl_in_reward=true",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "trainer.guard.kl_coef_mult=2.0",
        "trainer.logger=[console,wandb]",
        env={"WANDB_MODE": "offline"},
    )
    assert f"[rlhf-hpc] step {trip_step}: stability guard tripped: {expect}" in out.stdout, out.stdout[-3000:]
    assert f"rolled back to {run}/global_step_2 (step 2)" in out.stdout
    final = read_metrics(run)
    assert [r["training/global_step"] for r in final] == [1, 2, 3, 4, 5, 6]
    last = final[-1]
    assert all(math.isfinite(v) for v in last.values() if isinstance(v, float))
    assert last["guard/rollbacks"] == 1.0
    cfg = load_config("tiny_klppo")[0]
    assert last["actor/lr"] == pytest.approx(cfg.actor_rollout_ref.actor.optim.lr * 0.5)
    # the KL pull doubled, in the loss and in the reward (fixed controller: the coefficient itself)
    assert last["actor/kl_coef"] == pytest.approx(cfg.actor_rollout_ref.actor.kl_loss_coef * 2)
    assert last["actor/reward_kl_penalty_coeff"] == pytest.approx(cfg.algorithm.kl_ctrl.kl_coef * 2)
    before = {r["training/global_step"]: r for r in final if r["training/global_step"] <= 2}
    assert before[2]["actor/kl_coef"] == pytest.approx(cfg.actor_rollout_ref.actor.kl_loss_coef)
    # every logged row, the divergent step and the repeated ones included, is in each logger: W&B's
    # own step only grows, and training/global_step carries the training step
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["training/global_step"] for r in rows]
    assert steps == [1, 2, *range(3, trip_step + 1), *range(3, 7)]  # the rolled-back steps repeat
    assert [r["training/log_step"] for r in rows] == list(range(1, len(rows) + 1))
    history = wandb_history(next((run / "wandb").glob("offline-run-*/run-*.wandb")))
    assert [h["_step"] for h in history] == [r["training/log_step"] for r in rows]
    assert [h["training/global_step"] for h in history] == steps
    assert [h.get("guard/tripped") for h in history].count(1.0) == 1


@pytest.mark.slow
def test_a_collapse_at_lr_10_rolls_back_to_the_start_then_stops(tmp_path):
    """The demo at actor LR 10 collapses in its first update (entropy 4.14 -> 0, KL 4.2): the guard
    rolls back to the starting point (global_step_0, trainer.guard.initial_checkpoint) with the LR
    halved each time, and stops with the reason after max_rollbacks (LR 5, 2.5, 1.25 collapse too).
    Before: nothing tripped and the run ended "successfully"."""
    run = tmp_path / "run"
    out = train(run, "trainer.total_training_steps=6", "actor_rollout_ref.actor.optim.lr=10.0", ok=False)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert text.count(f"rolled back to {run}/global_step_0 (step 0)") == 3, out.stdout[-3000:]
    assert "stability guard tripped: actor/entropy" in text and "the policy collapsed" in text
    assert "stopping after 3 rollbacks (trainer.guard.max_rollbacks). Lower the learning rate" in text
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "0"  # a restart starts over, not from a bad step


@pytest.mark.parametrize("key", RESUME_KEYS)
def test_resume_is_refused_when_any_defining_key_changed(tmp_path, key):
    cfg, _ = load_config("tiny_klppo")
    ckpt_dir = tmp_path / "global_step_1"
    ckpt_dir.mkdir()
    (ckpt_dir / "config.yaml").write_text(dump_yaml(to_dict(cfg)))
    check_resume_compatible(ckpt_dir, cfg)  # unchanged: fine
    changed = copy.deepcopy(cfg)
    parent, _, leaf = key.rpartition(".")
    node = get_key(changed, parent)
    setattr(node, leaf, _different(getattr(node, leaf)))
    with pytest.raises(ConfigError) as e:
        check_resume_compatible(ckpt_dir, changed)
    assert any(line.startswith(f"{key}: ") for line in e.value.errors), e.value.errors


def _different(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, dict):
        return {**value, "rope_theta": 1234.0}
    if isinstance(value, list):
        return value + ["synthetic://copy?size=8"]
    if value is None:
        return "tiny://chars"
    if value == "fixed":
        return "adaptive"
    if value == "gae":
        return "grpo"
    return value + "?size=8" if value.startswith("synthetic://") else value + "-other"


@pytest.mark.slow
def test_run_files_are_not_world_writable(uninterrupted):
    for path in [uninterrupted, *uninterrupted.rglob("*")]:
        assert not path.stat().st_mode & 0o002, path


def test_out_of_memory_names_the_phase_and_the_keys():
    from rlhf_hpc.observability.perf import Timer
    from rlhf_hpc.ppo.trainer import out_of_memory_report

    timer = Timer()
    with pytest.raises(RuntimeError) as e:
        with timer("step"), out_of_memory_report(timer, torch.device("cpu")):
            with timer("update_actor"):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    msg = str(e.value)
    assert msg.startswith("out of memory in phase 'update_actor' on cpu (peak 0.0 GB allocated). Keys that reduce")
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu" in msg and "optimizer_offload" in msg
    assert isinstance(e.value.__cause__, torch.OutOfMemoryError)
