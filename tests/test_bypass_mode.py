"""verl's ``algorithm.rollout_correction.bypass_mode``: the engine's log-probs are the PPO anchor
and the actor's old-log-prob forward pass is skipped.

With an fp32 engine that agrees with the actor (|diff| ~1e-7), skipping the pass must not change
the training: two 4-step runs of the demo, bypass on and off, give the same rewards and, within a
stated tolerance, the same losses at every step. The standing rollout/actor check still runs in
bypass mode (on the update's first mini-batch, before its optimizer step), and combinations that
would make the anchor wrong are refused before launch.
"""

from __future__ import annotations

import pytest

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.observability.tracking import read_metrics
from rlhf_hpc.recipe.load import load_config
from tests.conftest import run_launch

STEPS = 4
# old log-probs differ by the engine/actor rounding (~1e-7 per token); over 4 steps the losses
# move by ~1e-6 relative, so 1e-3 is loose, and any real change of the update is far above it
TOLERANCE = 1e-3
SAME = (
    "actor/pg_loss",
    "actor/ppo_kl",
    "actor/pg_clipfrac",
    "actor/grad_norm",
    "critic/vf_loss",
    "critic/grad_norm",
    "critic/advantages/mean",
    "critic/returns/mean",
    "actor/reward_kl_penalty",
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for bypass in (False, True):
        run = tmp_path_factory.mktemp(f"bypass-{bypass}") / "run"
        proc = run_launch(
            "recipe=tiny_klppo",
            f"trainer.default_local_dir={run}",
            "actor_rollout_ref.rollout.name=hf",
            f"trainer.total_training_steps={STEPS}",
            "trainer.save_freq=0",
            "trainer.test_freq=0",
            f"algorithm.rollout_correction.bypass_mode={str(bypass).lower()}",
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        out[bypass] = read_metrics(run)
    return out


@pytest.mark.slow
def test_bypass_skips_the_forward_and_trains_the_same(runs):
    default, bypass = runs[False], runs[True]
    assert len(default) == len(bypass) == STEPS
    for d, b in zip(default, bypass):
        assert "timing_s/old_log_prob" in d and "timing_s/old_log_prob" not in b
        assert b["critic/score/mean"] == d["critic/score/mean"]  # the same responses were sampled
        for key in SAME:
            assert abs(b[key] - d[key]) <= TOLERANCE * max(1.0, abs(d[key])), (d["training/global_step"], key)


@pytest.mark.slow
def test_bypass_still_checks_the_engine_against_the_actor(runs):
    for r in runs[True]:
        # measured on the first mini-batch with the pre-update weights: fp32 engine == actor
        assert 0 < r["rollout/logprob_diff_max"] < 1e-4
        assert abs(r["rollout/engine_actor_kl"]) < 1e-5
        assert 0 < r["actor/entropy"] < 5  # from the same forward, not from a skipped pass
        assert "actor/rollout_entropy/mean" not in r


def test_bypass_combinations_that_break_the_anchor_are_refused():
    with pytest.raises(ConfigError, match=r"bypass_mode=true takes the engine's log-probs.*top_p=0.9.*set top_p=1.0"):
        load_config(
            "tiny_klppo", ["algorithm.rollout_correction.bypass_mode=true", "actor_rollout_ref.rollout.top_p=0.9"]
        )
    # the REINFORCE loss is bypass mode's (verl ignores it otherwise; here it is refused)
    with pytest.raises(ConfigError, match=r"loss_type=reinforce applies in bypass mode only"):
        load_config("tiny_klppo", ["algorithm.rollout_correction.loss_type=reinforce"])
    # verl's command line with the corrections off runs as it is
    cfg, _ = load_config(
        "tiny_klppo",
        [
            "algorithm.rollout_correction.bypass_mode=true",
            "algorithm.rollout_correction.loss_type=ppo_clip",
            "algorithm.rollout_correction.rollout_is=null",
            "algorithm.rollout_correction.rollout_is_threshold=2.0",
        ],
    )
    assert cfg.algorithm.rollout_correction.bypass_mode is True
