"""The RL math: hand-computed cases, properties, and global normalisation under any batch split."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_hpc.ops import algos
from rlhf_hpc.ops.algos import (
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_to_rewards,
    entropy_from_logits,
    entropy_from_logits_chunked,
    global_batch_counts,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    value_loss,
)
from rlhf_hpc.ops.estimators import (
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from rlhf_hpc.ops.policy_losses import ppo_clip_loss as policy_loss

T = torch.tensor
settings.register_profile("rlhf", max_examples=60, deadline=None)
settings.load_profile("rlhf")


def close(a, b, tol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol, rtol=0
    )


# ------------------------------------------------------------------------------ masked stats
def test_masked_mean_var_whiten():
    x, m = T([[1.0, 2.0, 3.0, 100.0]]), T([[1.0, 1.0, 1.0, 0.0]])
    close(masked_mean(x, m), 2.0)
    close(masked_mean(x, m, dim=-1), [2.0])
    close(masked_var(x, m), 1.0)  # unbiased: ((1)^2 + 0 + 1^2) / 2
    close(masked_var(x, m, unbiased=False), 2 / 3)
    w = masked_whiten(x, m)
    close(masked_mean(w, m), 0.0)
    close(masked_var(w, m), 1.0, tol=1e-6)
    close(masked_mean(masked_whiten(x, m, shift_mean=False), m), 2.0, tol=1e-6)
    with pytest.raises(ValueError, match="at least 2 valid elements"):
        masked_var(x, T([[1.0, 0, 0, 0]]))


class LockstepAllReduce:
    """An all-reduce between threads standing in for ranks: each rank's call blocks until every
    rank has contributed, then all get the reduction (what dist.all_reduce does): SUM, or
    ``reduce=lambda stacked: stacked.amax(0)`` for MAX."""

    def __init__(self, world: int, reduce=lambda stacked: stacked.sum(0)):
        self.world, self.slots, self.reduce = world, [None] * world, reduce
        self.barrier = threading.Barrier(world)

    def for_rank(self, rank: int):
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = t.detach().clone()
            self.barrier.wait()
            out = self.reduce(torch.stack(self.slots))
            self.barrier.wait()
            return out

        return all_reduce


def run_ranks(world: int, fn):
    """Run ``fn(rank, all_reduce)`` on ``world`` threads; returns the results by rank."""
    ar, results = LockstepAllReduce(world), [None] * world

    def target(rank):
        results[rank] = fn(rank, ar.for_rank(rank))

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    return results


def test_masked_stats_with_all_reduce_match_the_whole_batch():
    x = torch.randn(6, 5, dtype=torch.float64)
    m = (torch.rand(6, 5) > 0.3).double()
    m[:, 0] = 1
    rows = [slice(0, 2), slice(2, 6)]  # uneven shares
    out = run_ranks(
        2,
        lambda r, ar: (
            masked_mean(x[rows[r]], m[rows[r]], all_reduce=ar),
            masked_var(x[rows[r]], m[rows[r]], all_reduce=ar),
            masked_whiten(x[rows[r]], m[rows[r]], all_reduce=ar),
        ),
    )
    for r in (0, 1):
        close(out[r][0], masked_mean(x, m), tol=1e-12)
        close(out[r][1], masked_var(x, m), tol=1e-12)
        close(out[r][2], masked_whiten(x, m)[rows[r]], tol=1e-12)


# ------------------------------------------------------------------------------------------ GAE
def test_gae_closed_form():
    adv, ret = gae_advantages(T([[0.0, 0.0, 1.0]]), T([[0.5, 0.2, 0.1]]), torch.ones(1, 3), gamma=0.9, lam=0.8)
    close(adv, [[0.06736, 0.538, 0.9]])
    close(ret, [[0.56736, 0.738, 1.0]])


def test_gae_skips_a_masked_span():
    adv, ret = gae_advantages(T([[0.0, 5.0, 1.0]]), T([[0.5, 9.0, 0.1]]), T([[1.0, 0.0, 1.0]]), gamma=1.0, lam=1.0)
    close(adv, [[0.5, 0.0, 0.9]])
    close(ret, [[1.0, 0.0, 1.0]])


def _reward_to_go(r, gamma):
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype)
    for t in reversed(range(r.shape[1])):
        running = r[:, t] + gamma * running
        out[:, t] = running
    return out


def _masked_batch(seed, B, Tn):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B, Tn, generator=g, dtype=torch.float64)
    v = torch.randn(B, Tn, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, Tn + 1, (B,), generator=g)
    m = (torch.arange(Tn)[None, :] < lengths[:, None]).double()
    return r, v, m


@given(
    seed=st.integers(0, 10_000),
    B=st.integers(1, 4),
    Tn=st.integers(1, 8),
    gamma=st.floats(0.5, 1.0),
)
def test_gae_with_lam_1_is_reward_to_go_minus_values(seed, B, Tn, gamma):
    r, v, m = _masked_batch(seed, B, Tn)
    r, v = r * m, v * m  # right padding: nothing after the last valid token
    adv, ret = gae_advantages(r, v, m, gamma=gamma, lam=1.0)
    close(adv, (_reward_to_go(r, gamma) - v) * m, tol=1e-9)
    close(ret, _reward_to_go(r, gamma) * m, tol=1e-9)


@given(seed=st.integers(0, 10_000), B=st.integers(1, 4), Tn=st.integers(1, 8))
def test_gae_with_gamma_lam_1_and_zero_values_is_reward_to_go(seed, B, Tn):
    r, _, m = _masked_batch(seed, B, Tn)
    r = r * m
    adv, _ = gae_advantages(r, torch.zeros_like(r), m, gamma=1.0, lam=1.0)
    close(adv, _reward_to_go(r, 1.0) * m, tol=1e-9)


@given(
    seed=st.integers(0, 10_000),
    B=st.integers(1, 4),
    Tn=st.integers(2, 8),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
)
def test_gae_masked_positions_change_nothing(seed, B, Tn, gamma, lam):
    g = torch.Generator().manual_seed(seed + 1)
    r, v, _ = _masked_batch(seed, B, Tn)
    m = (torch.rand(B, Tn, generator=g) > 0.4).double()  # holes anywhere, not only padding
    adv, ret = gae_advantages(r, v, m, gamma, lam)
    noise = torch.randn(2, B, Tn, generator=g, dtype=torch.float64) * 100 * (1 - m)
    adv2, ret2 = gae_advantages(r + noise[0], v + noise[1], m, gamma, lam)
    close(adv, adv2, tol=1e-9)
    close(ret, ret2, tol=1e-9)


# ------------------------------------------------------------------------------------------- KL
def test_kl_estimators_closed_form():
    lp, ref = T([math.log(0.5)]), T([math.log(0.25)])
    close(kl_penalty(lp, ref, "kl"), [math.log(2)])
    close(kl_penalty(lp, ref, "k1"), [math.log(2)])
    close(kl_penalty(ref, lp, "abs"), [math.log(2)])
    close(kl_penalty(lp, ref, "mse"), [0.5 * math.log(2) ** 2])
    close(kl_penalty(lp, ref, "k2"), [0.5 * math.log(2) ** 2])
    close(kl_penalty(lp, ref, "low_var_kl"), [0.5 + math.log(2) - 1])
    close(kl_penalty(lp, ref, "k3"), [0.5 + math.log(2) - 1])
    # clamps as the reference: log-ratio to [-20, 20], value to [-10, 10]
    close(kl_penalty(T([50.0]), T([0.0]), "k3"), [10.0])
    close(kl_penalty(T([0.0]), T([50.0]), "k3"), [10.0])


def test_straight_through_kl_has_k3_value_and_k2_gradient():
    lp = T([-1.0, -2.0, -0.3], requires_grad=True)
    ref = T([-1.5, -1.0, -0.3])
    value = kl_penalty(lp, ref, "k3+")
    close(value.detach(), kl_penalty(lp, ref, "k3").detach())
    value.sum().backward()
    close(lp.grad, (lp - ref).detach())  # d/dlp 0.5 (lp - ref)^2


def test_unknown_kl_kind_lists_the_valid_ones():
    with pytest.raises(
        ValueError,
        match=r"unknown KL estimator 'k4'; valid kinds: kl, k1, abs, mse, k2, "
        r"low_var_kl, k3, kl\+",
    ):
        kl_penalty(T([0.0]), T([0.0]), "k4")


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_k1_and_k3_are_unbiased_estimators_of_kl(kind):
    g = torch.Generator().manual_seed(0)
    for trial in range(3):
        p = torch.softmax(torch.randn(6, generator=g), 0).double()
        q = torch.softmax(torch.randn(6, generator=g), 0).double()
        # k3's clamp at 10 (reference behaviour) biases it once q/p passes ~13; stay below that
        assert (q / p).max() < 12
        exact = (p * (p.log() - q.log())).sum()
        tokens = torch.multinomial(p, 400_000, replacement=True, generator=g)
        est = kl_penalty(p.log()[tokens], q.log()[tokens], kind)
        se = est.std() / math.sqrt(est.numel())
        assert abs(est.mean() - exact) < 5 * se, (kind, trial, est.mean().item(), exact.item(), se.item())


@given(lp=st.floats(-30, 0), ref=st.floats(-30, 0))
def test_k3_is_non_negative(lp, ref):
    assert kl_penalty(T([lp]), T([ref]), "k3").item() >= 0


# ----------------------------------------------------------------------------------- controllers
def test_fixed_controller_and_state():
    c = FixedKLController(0.05)
    c.update(current_kl=10.0, n_steps=100)
    assert c.value == 0.05
    c2 = FixedKLController(1.0)
    c2.load_state_dict(c.state_dict())
    assert c2.value == 0.05


def test_adaptive_controller_closed_form_and_state():
    c = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    c.update(current_kl=0.1, n_steps=10)  # error 1.0 clipped to 0.2
    assert c.value == pytest.approx(0.1 * 1.02)
    c.update(current_kl=0.055, n_steps=10)  # error 0.1
    assert c.value == pytest.approx(0.1 * 1.02 * 1.01)
    c2 = AdaptiveKLController(1.0, 1.0, 1)
    c2.load_state_dict(c.state_dict())
    assert (c2.value, c2.target, c2.horizon) == (c.value, 0.05, 100)


@given(kl=st.floats(0.0, 10.0), target=st.floats(0.001, 1.0), n=st.integers(1, 1000))
def test_adaptive_controller_direction_and_bound(kl, target, n):
    c = AdaptiveKLController(0.1, target, horizon=1000)
    c.update(kl, n)
    lo, hi = 0.1 * (1 - 0.2 * n / 1000), 0.1 * (1 + 0.2 * n / 1000)
    assert lo - 1e-12 <= c.value <= hi + 1e-12
    if kl > target * 1.0001:
        assert c.value > 0.1
    elif kl < target * 0.9999:
        assert c.value < 0.1


def test_make_kl_controller_from_config():
    from rlhf_hpc.config.schema import KLControlConfig

    assert isinstance(algos.make_kl_controller(KLControlConfig()), FixedKLController)
    c = algos.make_kl_controller(KLControlConfig(type="adaptive", kl_coef=0.2, target_kl=0.02, horizon=50))
    assert isinstance(c, AdaptiveKLController) and (c.value, c.target, c.horizon) == (0.2, 0.02, 50)


def test_apply_kl_to_rewards():
    scores = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    lp = T([[-1.0, -1.0, -1.0], [-1.0, -1.0, -9.0]])
    ref = T([[-1.5, -1.0, -0.5], [-2.0, -2.0, 0.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    c = AdaptiveKLController(0.1, target_kl=0.1, horizon=10)
    rewards, metrics = apply_kl_to_rewards(scores, lp, ref, mask, c, "kl")
    close(rewards, [[-0.05, 0.0, 1.05], [-0.1, 1.9, 0.0]])
    # per-sequence KL means: (0.5 + 0 - 0.5)/3 = 0 and (1 + 1)/2 = 1 -> batch mean 0.5
    assert metrics == {"actor/reward_kl_penalty": pytest.approx(0.5), "actor/reward_kl_penalty_coeff": 0.1}
    assert c.value == pytest.approx(0.1 * (1 + 0.2 * 2 / 10))  # KL above target, n_steps = batch size


def test_apply_kl_to_rewards_all_reduce_keeps_ranks_in_step():
    g = torch.Generator().manual_seed(3)
    lp, ref = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    mask, scores = (torch.rand(5, 4, generator=g) > 0.2).float(), torch.zeros(5, 4)
    mask[:, 0] = 1
    whole = AdaptiveKLController(0.1, 0.01, 100)
    _, m_whole = apply_kl_to_rewards(scores, lp, ref, mask, whole, "k3")
    rows = [slice(0, 2), slice(2, 5)]

    def rank_fn(r, ar):
        c = AdaptiveKLController(0.1, 0.01, 100)
        _, m = apply_kl_to_rewards(scores[rows[r]], lp[rows[r]], ref[rows[r]], mask[rows[r]], c, "k3", all_reduce=ar)
        return m, c.value

    for m, value in run_ranks(2, rank_fn):
        assert m["actor/reward_kl_penalty"] == pytest.approx(m_whole["actor/reward_kl_penalty"])
        assert value == pytest.approx(whole.value)


# ------------------------------------------------------------------------------------ agg_loss
def test_agg_loss_modes_closed_form():
    loss = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    close(agg_loss(loss, mask, "token-mean"), 7 / 3)
    close(agg_loss(loss, mask, "seq-mean-token-sum"), 3.5)
    close(agg_loss(loss, mask, "seq-mean-token-mean"), 2.75)
    close(agg_loss(loss, mask, "seq-mean-token-sum-norm"), 7 / 6)
    close(agg_loss(loss, mask, "seq-mean-token-sum-norm", norm_const=2.0), 7 / 4)
    close(agg_loss(loss, mask, "token-mean", global_tokens=7.0), 1.0)
    close(agg_loss(loss, mask, "seq-mean-token-mean", global_seqs=5.0), 5.5 / 5)
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'"):
        agg_loss(loss, mask, "mean")


# -------------------------------------------------------------------------------- policy loss
def test_policy_loss_closed_form_clip_and_dual_clip():
    old = torch.zeros(1, 4)
    lp = torch.log(T([[1.5, 0.5, 5.0, 1.0]]))
    adv = T([[1.0, -1.0, -1.0, 2.0]])
    mask = torch.ones(1, 4)
    loss, m = policy_loss(old, lp, adv, mask, 0.2, 0.2, 3.0, "token-mean")
    # per token: clip to 1.2 -> -1.2; clip to 0.8 -> 0.8; ratio 5, A<0 -> dual clip at 3; ratio 1 -> -2
    close(loss, (-1.2 + 0.8 + 3.0 - 2.0) / 4)
    close(m["pg_clipfrac"], 2 / 4)
    close(m["pg_clipfrac_lower"], 1 / 4)
    close(m["ppo_kl"], -lp.mean())


def test_policy_loss_rejects_clip_ratio_c_at_most_one():
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1.0"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip_ratio_c=1.0)


@given(seed=st.integers(0, 10_000), mode=st.sampled_from(algos.LOSS_AGG_MODES))
def test_policy_loss_is_the_plain_surrogate_at_ratio_one(seed, mode):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(3, 4, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 4, generator=g, dtype=torch.float64)
    mask = (torch.rand(3, 4, generator=g) > 0.3).double()
    loss, m = policy_loss(lp, lp.clone(), adv, mask, 0.2, 0.28, 3.0, mode)
    close(loss, agg_loss(-adv, mask, mode), tol=1e-12)
    assert m["pg_clipfrac"] == 0 and m["pg_clipfrac_lower"] == 0


@given(log_ratio=st.floats(-5, 5), a=st.floats(-10, -1e-3), c=st.floats(1.01, 10))
def test_dual_clip_caps_the_loss_of_negative_advantages(log_ratio, a, c):
    loss, _ = policy_loss(
        torch.zeros(1, 1, dtype=torch.float64),
        T([[log_ratio]], dtype=torch.float64),
        T([[a]], dtype=torch.float64),
        torch.ones(1, 1),
        0.2,
        0.2,
        c,
        "token-mean",
    )
    assert loss.item() <= -a * c + 1e-9


# --------------------------------------------------------------------------------- value loss
def test_value_loss_closed_form():
    v, old, ret, mask = T([[1.0, 0.2]]), T([[0.0, 0.0]]), T([[2.0, 0.0]]), torch.ones(1, 2)
    loss, clipfrac = value_loss(v, ret, old, mask, cliprange_value=0.5)
    # token 0: clipped value 0.5 -> max(1, 2.25); token 1: inside the range -> 0.04
    close(loss, 0.5 * (2.25 + 0.04) / 2)
    close(clipfrac, 0.5)


@given(seed=st.integers(0, 10_000))
def test_value_loss_is_mse_when_the_clip_range_is_huge(seed):
    g = torch.Generator().manual_seed(seed)
    v, old, ret = (torch.randn(3, 5, generator=g, dtype=torch.float64) for _ in range(3))
    mask = (torch.rand(3, 5, generator=g) > 0.3).double()
    loss, clipfrac = value_loss(v, ret, old, mask, cliprange_value=1e9)
    close(loss, 0.5 * masked_mean((v - ret) ** 2, mask), tol=1e-12)
    assert clipfrac == 0


# ----------------------------------------------------------------------- logits -> per token
def test_entropy_closed_form_and_stability():
    close(entropy_from_logits(torch.zeros(2, 7)), [math.log(7)] * 2)
    close(entropy_from_logits(T([[1e4, 0.0, -1e4]])), [0.0])
    p = T([0.7, 0.2, 0.1])
    close(entropy_from_logits(p.log()[None] + 123.0), [-(p * p.log()).sum()])
    assert torch.isfinite(entropy_from_logits(T([[float("-inf"), 0.0, 1.0]]))).all()


def test_chunked_entropy_equals_unchunked_in_value_and_gradient():
    logits = torch.randn(3, 10, 50, dtype=torch.float64, requires_grad=True)
    full = entropy_from_logits(logits)
    (g_full,) = torch.autograd.grad(full.sum(), logits)
    chunked = entropy_from_logits_chunked(logits, chunk_size=7)
    (g_chunk,) = torch.autograd.grad(chunked.sum(), logits)
    close(chunked, full, tol=1e-12)
    close(g_chunk, g_full, tol=1e-12)
    with torch.no_grad():
        close(entropy_from_logits_chunked(logits, chunk_size=4), full.detach(), tol=1e-12)


def test_logprobs_from_logits():
    logits = torch.randn(2, 3, 11)
    labels = torch.randint(0, 11, (2, 3))
    close(
        logprobs_from_logits(logits, labels),
        torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1),
        tol=1e-6,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_token_logprobs_equal_the_full_fp32_upcast(dtype):
    """What actor.per_token_logprobs computed before chunking: a full fp32 copy divided by the
    temperature, then log-softmax and entropy over it; values and gradients to 1e-5."""
    from rlhf_hpc.ops.algos import token_logprobs_chunked

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 300, generator=g) * 3).to(dtype).requires_grad_(True)
    labels = torch.randint(0, 300, (37,), generator=g)
    upcast = logits.float() / 0.7
    lp_ref, ent_ref = logprobs_from_logits(upcast, labels), entropy_from_logits(upcast)
    g_ref = torch.autograd.grad((lp_ref * 1.3 + ent_ref * 0.1).sum(), logits, retain_graph=True)[0]
    lp, ent = token_logprobs_chunked(logits, labels, 0.7, with_entropy=True, chunk_size=8)
    g_chunk = torch.autograd.grad((lp * 1.3 + ent * 0.1).sum(), logits)[0]
    assert lp.dtype == ent.dtype == torch.float32 and g_chunk.dtype == dtype
    assert (lp - lp_ref).abs().max() <= 1e-5 and (ent - ent_ref).abs().max() <= 1e-5
    # the gradient reaches the logits in their dtype: the entropy's and the log-prob's parts are
    # rounded to bf16 apart (chunks are recomputed separately), so bf16 agrees to its own precision
    parts = [torch.autograd.grad(f.sum(), upcast, retain_graph=True)[0].abs() for f in (lp_ref * 1.3, ent_ref * 0.1)]
    tol = 1e-5 + (2**-7 * (parts[0] + parts[1] + g_ref.float().abs()) if dtype == torch.bfloat16 else 0)
    assert ((g_chunk.float() - g_ref.float()).abs() <= tol).all()
    # the log-probs' own backward (written out, not autograd's): the same gradient to fp32 rounding,
    # then rounded once to the logits' dtype (one bf16 step apart at most)
    g_lp = torch.autograd.grad(token_logprobs_chunked(logits, labels, 0.7, chunk_size=8)[0].sum(), logits)[0]
    g_lp_ref = torch.autograd.grad(logprobs_from_logits(logits.float() / 0.7, labels).sum(), logits)[0]
    step = 1e-6 + (2**-7 * g_lp_ref.float().abs() if dtype == torch.bfloat16 else 1e-6 * g_lp_ref.abs())
    assert ((g_lp.float() - g_lp_ref.float()).abs() <= step).all() and g_lp.float().abs().sum() > 1
    # entropy for metrics only: no graph through it; without entropy: none computed
    lp2, ent2 = token_logprobs_chunked(logits, labels, 0.7, with_entropy=True, entropy_grad=False, chunk_size=8)
    assert lp2.requires_grad and not ent2.requires_grad and torch.equal(ent2, ent.detach())
    assert token_logprobs_chunked(logits, labels, 0.7, chunk_size=5)[1] is None


# -------------------------------------------------------------------- outcome estimators
def _outcome(scores, lengths, Tn=4):
    mask = (torch.arange(Tn)[None, :] < T(lengths)[:, None]).float()
    rewards = torch.zeros(len(scores), Tn)
    rewards[torch.arange(len(scores)), T(lengths) - 1] = T(scores)  # score on the last valid token
    return rewards, mask


def test_grpo_closed_form():
    rewards, mask = _outcome([1.0, 0.0, 1.0, 0.0, 3.0], [2, 4, 1, 3, 2])
    adv, ret = grpo_advantages(rewards, mask, index=["a", "a", "a", "a", "b"])
    z = 0.5 / math.sqrt(1 / 3)  # group mean 0.5, unbiased std sqrt(1/3)
    close(adv[:, 0], [z, -z, z, -z, 3.0], tol=1e-5)  # a group of one keeps its score
    close(adv * (1 - mask), torch.zeros_like(adv))
    assert torch.equal(adv, ret)
    adv_dr, _ = grpo_advantages(rewards, mask, index=["a", "a", "a", "a", "b"], norm_by_std=False)
    close(adv_dr[:, 0], [0.5, -0.5, 0.5, -0.5, 3.0])


def test_rloo_closed_form():
    rewards, mask = _outcome([1.0, 0.0, 0.0, 2.0], [1, 2, 3, 1])
    adv, _ = rloo_advantages(rewards, mask, index=T([0, 0, 0, 1]))
    close(adv[:, 0], [1.0, -0.5, -0.5, 2.0])  # score - mean of the others


def test_reinforce_pp_closed_form():
    rewards, mask = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]]), T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    close(adv, masked_whiten(ret, mask) * mask)
    close(masked_mean(adv, mask), 0.0)


def test_reinforce_pp_baseline():
    rewards, mask = _outcome([1.0, 0.0, 4.0, 2.0], [1, 2, 2, 1], Tn=2)
    adv, _ = reinforce_pp_baseline_advantages(rewards, mask, index=[0, 0, 1, 1])
    centred = T([0.5, -0.5, 1.0, -1.0])[:, None] * mask
    close(adv, masked_whiten(centred, mask) * mask, tol=1e-6)


# ------------------------------------------------------- global normalisation under any split
class _TinyPolicy(torch.nn.Module):
    """log-probs and values that depend on parameters, so gradients can be compared."""

    def __init__(self, dim=6):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(dim, generator=g) * 0.3)
        self.v = torch.nn.Parameter(torch.randn(dim, generator=g) * 0.3)

    def forward(self, feats):  # (B, T, D) -> (B, T), (B, T)
        return torch.nn.functional.logsigmoid(feats @ self.w), feats @ self.v


def _mini_batch(B=8, Tn=6, D=6):
    g = torch.Generator().manual_seed(1)
    lengths = T([1, 6, 2, 5, 3, 6, 4, 2])
    mask = (torch.arange(Tn)[None, :] < lengths[:, None]).float()
    return dict(
        feats=torch.randn(B, Tn, D, generator=g),
        old_lp=torch.randn(B, Tn, generator=g) * 0.1 - 0.7,
        adv=torch.randn(B, Tn, generator=g),
        returns=torch.randn(B, Tn, generator=g),
        old_v=torch.randn(B, Tn, generator=g),
        mask=mask,
    )


def _trim(part):
    """Drop padding columns no row of this micro-batch uses: micro-batches have different widths."""
    width = int(part["mask"].sum(-1).max().item())
    return {k: v[:, :width] for k, v in part.items()}


def _loss(model, part, mode, counts):
    lp, v = model(part["feats"])
    kw = dict(global_tokens=counts[0], global_seqs=counts[1], norm_const=6.0)
    pg, _ = policy_loss(part["old_lp"], lp, part["adv"], part["mask"], 0.2, 0.2, 3.0, mode, **kw)
    vf, _ = value_loss(v, part["returns"], part["old_v"], part["mask"], 0.5, mode, **kw)
    return pg + vf


def _split(batch, rows):
    return _trim({k: v[rows] for k, v in batch.items()})


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_loss_and_gradients_do_not_depend_on_the_split(mode):
    batch = _mini_batch()

    def run(layout):
        """layout: per rank, a list of micro-batch row lists. Returns (mini-batch loss, averaged grads)."""
        dp = len(layout)
        masks = [[_split(batch, rows)["mask"] for rows in rank] for rank in layout]
        local = [global_batch_counts(m) for m in masks]

        def all_reduce(t):  # what dist.all_reduce(SUM) over the simulated ranks returns
            return torch.tensor([sum(c[0] for c in local), sum(c[1] for c in local)], dtype=t.dtype)

        grads, total = [], 0.0
        for rank, rank_masks in zip(layout, masks):
            model = _TinyPolicy()
            counts = global_batch_counts(rank_masks, all_reduce=all_reduce)
            for rows in rank:  # gradient accumulation over micro-batches
                loss = _loss(model, _split(batch, rows), mode, counts) * dp  # FSDP averages over dp
                loss.backward()
                total += loss.item() / dp
            grads.append(torch.cat([model.w.grad, model.v.grad]))
        return total, torch.stack(grads).mean(0)

    rows = list(range(8))
    ref_loss, ref_grad = run([[rows]])
    for layout in (
        [[[0, 1], [2, 3], [4, 5], [6, 7]]],  # 4 micro-batches x 1 rank
        [[[0, 1], [2, 3]], [[4, 5], [6, 7]]],  # 2 micro-batches x 2 ranks
        [[[7], [0, 3, 5]], [[1, 2], [4, 6]]],
    ):  # uneven, shuffled
        loss, grad = run(layout)
        # (token-sum is a sum, not a mean: its float32 rounding grows with its size, ~20 here)
        scale = max(1.0, abs(ref_loss)) if mode == "token-sum" else 1.0
        close(loss, ref_loss, tol=1e-6 * scale)
        close(grad, ref_grad, tol=1e-6 * scale)
