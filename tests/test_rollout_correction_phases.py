"""The rollout correction as the actor's object (``rlhf_hpc.ppo.rollout_correction.RolloutCorrection``):
one call per phase of the trainer, each giving what ``rlhf_hpc.ops.rollout_corr_helper`` gives on
the same tensors; and the guard's scales applied through ``Actor.scale``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.schema import ActorConfig, RolloutCorrectionConfig
from rlhf_hpc.ops.rollout_corr_helper import rollout_correction
from rlhf_hpc.ppo.actor import Actor, ActorSpec
from rlhf_hpc.ppo.optim import build_lr_scheduler, build_optimizer
from rlhf_hpc.ppo.rollout_correction import RolloutCorrection
from rlhf_hpc.rollout.base import LogprobCheck

B, R = 6, 5


def step_batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, R, generator=g) > 0.2).float()
    engine = -torch.rand(B, R, generator=g) * mask
    return {
        "engine_log_probs": engine,
        "old_log_probs": (engine + 0.05 * torch.randn(B, R, generator=g)) * mask,
        "response_mask": mask,
    }


def correction(lines: list, **cfg) -> RolloutCorrection:
    return RolloutCorrection(RolloutCorrectionConfig(**cfg), LogprobCheck("bfloat16", "float32"), log=lines.append)


def test_decoupled_phases_are_the_ops_on_the_whole_step():
    cfg = dict(rollout_is="token", rollout_is_threshold=1.02, rollout_rs="token_k3", rollout_rs_threshold=1e-3)
    batch, lines, metrics = step_batch(), [], {}
    corr = correction(lines, **cfg)
    weights, mask, expected = rollout_correction(
        batch["old_log_probs"], batch["engine_log_probs"], batch["response_mask"], RolloutCorrectionConfig(**cfg)
    )
    sampled = batch["response_mask"]
    corr.after_old_log_probs(batch, 1, metrics)
    assert metrics["rollout/logprob_diff_max"] > 0 and not lines  # the check ran, within the bf16 limit
    corr.before_advantages(batch, metrics)
    assert torch.equal(batch["rollout_is_weights"], weights) and torch.equal(batch["response_mask"], mask)
    assert batch["sampled_response_mask"] is sampled
    assert {k: metrics[k] for k in expected} == expected
    corr.after_update(batch, 1, metrics)  # nothing left to check in decoupled mode


def test_decoupled_refuses_a_step_with_every_token_rejected():
    batch = step_batch()
    with pytest.raises(ConfigError, match="rejected every response token"):
        correction([], rollout_rs="token_k1", rollout_rs_threshold="0.999_1.001").before_advantages(batch, {})


def test_bypass_phases_anchor_on_the_engine_and_check_the_first_mini_batch():
    cfg = dict(bypass_mode=True, rollout_is="token", rollout_is_threshold=2.0)
    batch, lines, metrics = step_batch(), [], {}
    corr = correction(lines, **cfg)
    corr.after_old_log_probs(batch, 3, metrics)
    assert torch.equal(batch["old_log_probs"], batch["engine_log_probs"]) and not metrics
    corr.before_advantages(batch, metrics)
    assert "rollout_is_weights" not in batch and not metrics
    assert corr.begin_update(batch) is batch
    assert corr.keeps_pre_update(1) and not corr.keeps_pre_update(2)
    current = batch["engine_log_probs"] - 0.5 * batch["response_mask"]  # far from the engine: the check warns
    for i in (0, B // 2):  # two micro-batches of the first mini-batch
        micro, lp = {k: v[i : i + B // 2] for k, v in batch.items()}, current[i : i + B // 2]
        corr.keep_pre_update(micro, lp)
        w, m = corr.micro_batch(micro, lp, micro["response_mask"], 1.0)
        ref_w, ref_m, _ = rollout_correction(
            lp, micro["old_log_probs"], micro["response_mask"], RolloutCorrectionConfig(**cfg), with_metrics=False
        )
        assert torch.equal(w, ref_w) and torch.equal(m, ref_m)
    expected = rollout_correction(
        current, batch["engine_log_probs"], batch["response_mask"], RolloutCorrectionConfig(**cfg)
    )[2]
    assert corr.update_metrics() == expected
    corr.after_update(batch, 3, metrics)
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(0.5)
    assert lines and lines[0].startswith("[rlhf-hpc] WARNING step 3: ")
    assert corr.pre_update == [] and corr.trained == []


def test_guard_scales_act_through_the_actor():
    model = torch.nn.Linear(2, 2)
    cfg = dataclasses.replace(ActorConfig(), kl_loss_coef=0.01)
    opt = build_optimizer(model, cfg.optim)
    actor = Actor(model, cfg, ActorSpec(optimizer=opt, scheduler=build_lr_scheduler(opt, cfg.optim, 10)))
    lr = opt.param_groups[0]["lr"]
    actor.scale(0.5, 2.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(lr * 0.5) and actor.kl_loss_coef == pytest.approx(0.02)
    actor.scale(0.25, 4.0)  # relative to the configured settings, not compounding
    assert opt.param_groups[0]["lr"] == pytest.approx(lr * 0.25) and actor.kl_loss_coef == pytest.approx(0.04)
    assert cfg.kl_loss_coef == 0.01
