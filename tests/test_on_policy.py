"""On-policy updates take pi_old from their own forward (``ops.step_shape.old_log_prob_source``):
with one epoch of one mini-batch the old-log-prob pass would compute the numbers the update's first
forward computes again, so it is skipped, and the rollout/actor check runs on that forward.

- Which configs qualify, and why the others do not (each reader of pi_old before the update).
- The update equals the two-pass update bit for bit where the pass gives the update's numbers
  (same micro-batches): losses, metrics, gradients, weights; pi_old comes back in row order.
- The plans drop the pass where it does not run.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_hpc.config.schema import ActorConfig, RolloutCorrectionConfig
from rlhf_hpc.models.hf import build_causal_lm
from rlhf_hpc.ops.step_shape import old_log_prob_source
from rlhf_hpc.planning.memory_plan import build_plan
from rlhf_hpc.planning.time_plan import build_time_plan
from rlhf_hpc.ppo.actor import Actor, ActorSpec
from rlhf_hpc.ppo.optim import build_optimizer
from rlhf_hpc.ppo.rollout_correction import RolloutCorrection
from rlhf_hpc.recipe.load import load_config
from rlhf_hpc.rollout.base import LogprobCheck
from tests.test_training_models import grads_of, skewed_batch

ACTOR = "actor_rollout_ref.actor."
RC = "algorithm.rollout_correction."


@pytest.mark.parametrize(
    "recipe, overrides, source",
    [
        ("smollm2_add_grpo", [], "update"),
        ("smollm2_add_gspo", [], "update"),
        ("smollm2_add_dapo", [], "update"),
        ("smollm2_add_grpo", [f"{ACTOR}ppo_epochs=2"], "pass"),
        ("smollm2_add_grpo", [f"{ACTOR}ppo_mini_batch_size=8"], "pass"),  # two mini-batches: the second is off-policy
        ("smollm2_add_grpo", ["algorithm.use_kl_in_reward=true", f"{ACTOR}use_kl_loss=false"], "pass"),
        ("smollm2_add_grpo", [f"{RC}rollout_is=token"], "pass"),  # IS weights pi_old / pi_rollout before advantages
        ("smollm2_add_grpo", [f"{RC}rollout_rs=token_k3", f"{RC}rollout_rs_threshold=0.01"], "pass"),
        (
            "smollm2_add_grpo",
            ["algorithm.adv_estimator=optimal_token_baseline", f"{ACTOR}calculate_sum_pi_squared=true"],
            "pass",
        ),
        ("smollm2_add_grpo", [f"{RC}bypass_mode=true"], "engine"),
        ("smollm2_add_klppo", [], "pass"),  # the KL in the reward reads pi_old
        ("smollm2_add_klppo", ["algorithm.use_kl_in_reward=false", "trainer.critic_warmup=1"], "pass"),
        ("tiny_klppo", [], "pass"),
    ],
)
def test_the_source_of_pi_old_follows_what_reads_it(recipe, overrides, source):
    cfg, _ = load_config(recipe, overrides, check_files=False)  # (a fresh machine has no SmolLM2 on disk yet)
    assert old_log_prob_source(cfg) == source


@pytest.mark.slow
def test_the_plans_drop_the_pass_that_does_not_run(smollm):
    for overrides, runs in (([], False), ([f"{ACTOR}ppo_epochs=2"], True)):
        cfg, _ = load_config("smollm2_add_grpo", [f"actor_rollout_ref.model.path={smollm}", *overrides])
        assert ("old_log_prob" in [p.name for p in build_plan(cfg).phases]) is runs
        assert ("old_log_prob" in [p.name for p in build_time_plan(cfg).phases]) is runs


def actor_and_batch(anchor: str) -> tuple[Actor, dict]:
    model = build_causal_lm("tiny://qwen2", torch.float32, seed=0)
    cfg = ActorConfig(
        ppo_micro_batch_size_per_gpu=3,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        shuffle=False,
        loss_agg_mode="token-mean",
    )
    corr = RolloutCorrection(
        RolloutCorrectionConfig(),
        LogprobCheck("float32", "float32"),
        anchor=anchor,
        all_reduce_sum=lambda t: t,
        all_reduce_max=lambda t: t,
        log=lambda line: None,
    )
    actor = Actor(
        model, cfg, ActorSpec(remove_padding=True, optimizer=build_optimizer(model, cfg.optim), correction=corr)
    )
    batch = skewed_batch(n=6)
    g = torch.Generator().manual_seed(3)
    batch["engine_log_probs"] = -torch.rand(batch["response_mask"].shape, generator=g) * batch["response_mask"]
    return actor, batch


def test_the_on_policy_update_is_the_two_pass_update_bit_for_bit():
    two, batch_two = actor_and_batch("pass")
    lp, _ = two.compute_log_prob(batch_two, 3)  # the pass, on the update's micro-batches
    batch_two["old_log_probs"] = lp
    metrics_two = two.update_policy(batch_two, mini_batch_rows=6)
    one, batch_one = actor_and_batch("update")
    metrics_one = one.update_policy(batch_one, mini_batch_rows=6)
    assert "old_log_probs" not in batch_one  # no pass ran
    metrics_check: dict = {}
    one.correction.after_update(batch_one, 1, metrics_check)
    assert torch.equal(batch_one["old_log_probs"], lp)  # the update's own forward, back in row order
    assert torch.equal(grads_of(one.model), grads_of(two.model))
    for a, b in zip(one.model.parameters(), two.model.parameters()):
        assert torch.equal(a, b)
    entropy = metrics_one.pop("actor/entropy")  # the pass reports it in a two-pass step
    assert metrics_one == metrics_two and entropy > 0
    assert metrics_one["actor/ppo_kl"] == 0.0 and metrics_one["actor/pg_clipfrac"] == 0.0
    # the off-policy figures the two-pass step computes before the advantages, from the same pi_old
    metrics_pass: dict = {}
    two.correction.before_advantages(batch_two, metrics_pass)
    corr = {k: v for k, v in metrics_check.items() if k.startswith("rollout_corr/")}
    assert corr and corr == metrics_pass
    # the rollout/actor check ran on the same forward, against the engine's log-probs
    mask = batch_one["response_mask"].bool()
    assert metrics_check["rollout/logprob_diff_max"] == pytest.approx(
        float((lp - batch_one["engine_log_probs"])[mask].abs().max())
    )


def test_the_on_policy_update_reports_the_entropy_the_pass_would():
    one, batch = actor_and_batch("update")
    metrics = one.update_policy(batch, mini_batch_rows=6)
    two, batch_two = actor_and_batch("pass")
    _, ent = two.compute_log_prob(batch_two, 3, with_entropy=True)
    mask = batch_two["response_mask"]
    assert metrics["actor/entropy"] == pytest.approx(float((ent * mask).sum() / mask.sum()), rel=1e-6)
