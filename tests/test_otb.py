"""verl's Optimal Token Baseline as registered estimators (``optimal_token_baseline``,
``tir_optimal_token_baseline``): sum_v pi(v)^2 from the actor's old-log-prob pass
(``actor.calculate_sum_pi_squared``), the estimators through ``compute_advantages`` against verl's
code (tests/test_estimators_verl.py), the trainer's phase 3 and 6 wiring, and the dry run's checks.
Under Ulysses the sum is compared with sp=1 by tests/dist_sp_checks.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.ops.algos import sum_pi_squared_chunked
from rlhf_hpc.ops.estimators import ADV_ESTIMATORS, AdvantageInputs, compute_advantages
from rlhf_hpc.recipe.load import load_config
from tests.test_algos import run_ranks
from tests.test_estimators_verl import otb_inputs, verl_otb, verl_tir_otb

OTB = ["optimal_token_baseline", "tir_optimal_token_baseline"]
ON = "actor_rollout_ref.actor.calculate_sum_pi_squared=true"


def direct_sum_pi_squared(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return (torch.softmax(logits.double() / temperature, -1) ** 2).sum(-1)


# ---------------------------------------------------------------------------------- sum pi^2
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sum_pi_squared_chunked_equals_the_softmax(dtype, temperature):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 300, generator=g) * 4 + 50).to(dtype)  # a large common offset: no overflow
    logits[3, 7] += 30  # one near-certain token: sum pi^2 ~ 1
    out = sum_pi_squared_chunked(logits, temperature, chunk_size=8)
    assert out.dtype == torch.float32 and out.shape == (37,)
    torch.testing.assert_close(out.double(), direct_sum_pi_squared(logits.float(), temperature), rtol=1e-5, atol=1e-7)
    assert out[3] > 0.99 and (out > 0).all() and (out <= 1 + 1e-6).all()
    assert sum_pi_squared_chunked(logits[:0], temperature).shape == (0,)
    with torch.enable_grad():  # never a graph, even from logits that have one
        assert not sum_pi_squared_chunked(logits.float().requires_grad_(True), temperature).requires_grad


def test_the_actor_gives_sum_pi_squared_beside_its_log_probs_and_nothing_else_changes():
    from rlhf_hpc.config.schema import ActorConfig
    from rlhf_hpc.models.hf import build_causal_lm
    from rlhf_hpc.ops.batching import make_padded_batch
    from rlhf_hpc.ppo.actor import Actor, ActorSpec, per_token_logprobs

    model = build_causal_lm("tiny://qwen2?vocab_size=200&num_hidden_layers=2", torch.float32, seed=3)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 200, (n,), generator=g).tolist() for n in (6, 3, 5)]
    resps = [torch.randint(1, 200, (n,), generator=g).tolist() for n in (4, 2, 5)]
    b = make_padded_batch(prompts, resps, 0, 6, 5)
    mask = b["response_mask"].bool()
    with torch.no_grad():
        full = model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        ).logits[:, -6:-1]  # the logits predicting each response token
    expected = torch.where(mask, direct_sum_pi_squared(full, 0.7), 0.0)
    for packed in (True, False):
        with torch.no_grad():
            lp, ent, spi2 = per_token_logprobs(model, b, 0.7, packed, with_entropy=True, with_sum_pi_squared=True)
            lp0, ent0 = per_token_logprobs(model, b, 0.7, packed, with_entropy=True)
        torch.testing.assert_close(spi2.double(), expected, rtol=1e-5, atol=1e-6)
        assert torch.equal(lp, lp0) and torch.equal(ent, ent0)
    actor = Actor(model, ActorConfig(), ActorSpec(temperature=0.7))
    lp, ent, spi2 = actor.compute_log_prob(b, micro_batch_size=2, with_entropy=True, with_sum_pi_squared=True)
    torch.testing.assert_close(spi2.double(), expected, rtol=1e-5, atol=1e-6)
    assert len(actor.compute_log_prob(b, micro_batch_size=2)) == 2  # not asked: (log-probs, None) as before


# ------------------------------------------------------------------------------ the estimators
def algo(name):
    return SimpleNamespace(adv_estimator=name, norm_adv_by_std_in_grpo=True, gamma=1.0, lam=1.0)


@pytest.mark.parametrize(
    "name,verl", [("optimal_token_baseline", verl_otb), ("tir_optimal_token_baseline", verl_tir_otb)]
)
@pytest.mark.parametrize("with_is", [False, True])
def test_registered_otb_equals_verls_code(name, verl, with_is):
    for seed in range(6):
        rewards, mask, index, lp, spi2, w = otb_inputs(seed, holes=seed % 2 == 0)
        w = w if with_is else None
        adv, ret = compute_advantages(
            algo(name),
            AdvantageInputs(rewards, mask, index, old_log_probs=lp, sum_pi_squared=spi2, rollout_is_weights=w),
        )
        ref_adv, ref_ret = verl(rewards, mask, index.tolist(), lp, spi2, w)  # verl's defaults (handle_zero_tail)
        torch.testing.assert_close(adv, ref_adv, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ret, ref_ret * mask)


@pytest.mark.parametrize("name", OTB)
def test_registered_otb_over_two_ranks_equals_the_whole_batch(name):
    rewards, mask, index, lp, spi2, w = otb_inputs(2, holes=True)
    whole = compute_advantages(
        algo(name),
        AdvantageInputs(
            rewards, mask, index, num_groups=5, old_log_probs=lp, sum_pi_squared=spi2, rollout_is_weights=w
        ),
    )
    halves = [slice(0, 9), slice(9, 16)]
    out = run_ranks(
        2,
        lambda r, ar: compute_advantages(
            algo(name),
            AdvantageInputs(
                rewards[halves[r]],
                mask[halves[r]],
                index[halves[r]],
                num_groups=5,
                all_reduce=ar,
                old_log_probs=lp[halves[r]],
                sum_pi_squared=spi2[halves[r]],
                rollout_is_weights=w[halves[r]],
            ),
        ),
    )
    for i in range(2):
        torch.testing.assert_close(torch.cat([o[i] for o in out]), whole[i], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", OTB)
def test_otb_without_sum_pi_squared_says_which_key_gives_it(name):
    rewards, mask, index, lp, _, _ = otb_inputs(0)
    with pytest.raises(ValueError, match="calculate_sum_pi_squared=true"):
        compute_advantages(algo(name), AdvantageInputs(rewards, mask, index, old_log_probs=lp))


def test_the_otb_entries_declare_sum_pi_squared():
    for name in OTB:
        e = ADV_ESTIMATORS[name]
        assert e.needs_sum_pi_squared and e.grouped and not e.needs_critic and not e.needs_greedy_baseline
    assert [n for n in ADV_ESTIMATORS if ADV_ESTIMATORS[n].needs_sum_pi_squared] == OTB


# -------------------------------------------------------------------------- trainer, phase 3
class FakeActor:
    def __init__(self, bypass=False):
        self.calls = []
        self.routing = None  # (a dense model: no routing replay)
        self.correction = SimpleNamespace(
            bypass=bypass, anchor="engine" if bypass else "pass", after_old_log_probs=lambda batch, step, metrics: None
        )

    def compute_log_prob(self, batch, *args, with_entropy=False, with_sum_pi_squared=False, routing_out=None):
        self.calls.append(with_sum_pi_squared)
        lp = torch.full(batch["response_mask"].shape, -1.0)
        return (lp, lp * 0, lp * 0 + 0.25) if with_sum_pi_squared else (lp, lp * 0)


@pytest.mark.parametrize(
    "overrides,stored",
    [([], False), (["algorithm.adv_estimator=optimal_token_baseline", ON, "actor_rollout_ref.rollout.n=4"], True)],
)
def test_phase_3_stores_sum_pi_squared_only_when_asked(overrides, stored):
    from rlhf_hpc.observability.perf import Timer
    from rlhf_hpc.ppo.trainer import PPOTrainer

    config, _ = load_config("tiny_klppo", overrides)
    t = object.__new__(PPOTrainer)  # phase 3 alone: a fake actor, no reference, no critic
    t.cfg, actor = config, FakeActor()
    t.models = SimpleNamespace(actor=actor, ref=None, critic=None)
    part = SimpleNamespace(micro_rows=2, dynamic=False, token_budget=64)
    t.shape = SimpleNamespace(old_log_prob=part)
    batch = {"response_mask": torch.ones(3, 4)}
    t.log_probs_and_values(batch, 1, Timer(), {})
    assert actor.calls == [stored] and ("sum_pi_squared" in batch) == stored
    assert torch.equal(batch["old_log_probs"], torch.full((3, 4), -1.0))


# ------------------------------------------------------------------------------- the dry run
@pytest.mark.parametrize("name", OTB)
def test_otb_runs_with_verls_key_and_no_critic(name):
    config, _ = load_config("tiny_klppo", [f"algorithm.adv_estimator={name}", ON, "actor_rollout_ref.rollout.n=4"])
    assert config.actor_rollout_ref.actor.calculate_sum_pi_squared and config.critic.enable is False


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["algorithm.adv_estimator=optimal_token_baseline", "actor_rollout_ref.rollout.n=4"],
            "set actor_rollout_ref.actor.calculate_sum_pi_squared=true (verl requires it as well)",
        ),
        (
            [
                "algorithm.adv_estimator=tir_optimal_token_baseline",
                "actor_rollout_ref.rollout.n=4",
                ON,
                "algorithm.rollout_correction.bypass_mode=true",
            ],
            "which algorithm.rollout_correction.bypass_mode=true skips",
        ),
        ([ON], "calculate_sum_pi_squared=true: only optimal_token_baseline, tir_optimal_token_baseline read it"),
        (["actor_rollout_ref.actor.sum_pi_squared_checkpointing=true"], "there is nothing to checkpoint"),
    ],
)
def test_the_dry_run_refuses_otb_without_its_input_and_the_keys_without_an_effect(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config("tiny_klppo", overrides)
    assert any(message in line for line in e.value.errors), e.value.errors
