"""verl's policy losses gspo, sapo, clip_cov, kl_cov, geo_mean (GMPO) and cispo, added through the
registry (docs/extending.md: one function each in ops/policy_losses.py): equal to verl's code
(transcribed below from verl b178a3c's ``core_algos.py``) on random tensors in value, metrics and
gradient, split-invariant where verl's loss is, and their keys (verl's names and defaults) refused
where another loss is selected; the clip-ratio range checks follow what the selected loss clips."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.schema import ActorConfig
from rlhf_hpc.models.hf import build_causal_lm
from rlhf_hpc.ops.algos import global_batch_counts
from rlhf_hpc.ops.policy_losses import DIVERGENCE, IS_WEIGHT, LOG_RATIO, POLICY_LOSSES, PPO_RATIO
from rlhf_hpc.ppo.actor import Actor, ActorSpec
from rlhf_hpc.ppo.optim import build_optimizer
from rlhf_hpc.recipe.load import load_config
from tests.test_training_models import grads_of, skewed_batch

NEW = ["gspo", "sapo", "clip_cov", "kl_cov", "geo_mean", "cispo", "dppo_tv", "dppo_kl", "dro"]
MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KEY = "actor_rollout_ref.actor."


# ------------------------------------------------------------ verl's code, as written there
def verl_masked_mean(values, mask):
    return (values * mask).sum() / (mask.sum() + 1e-8)


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode):
    """verl 0.9.1's agg_loss on one unsplit batch (dp_size 1, no global counts)."""
    if loss_agg_mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    if loss_agg_mode == "token-sum":
        return (loss_mat * loss_mask).sum()
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        loss = (seq_losses * seq_mask).sum() / seq_mask.sum()
        return loss / loss_mask.shape[-1] if loss_agg_mode == "seq-mean-token-sum-norm" else loss
    if loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        return (seq_losses * seq_mask).sum() / seq_mask.sum()
    raise ValueError(loss_agg_mode)


def verl_gspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None):
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode)  # 0.9.1: the mode given
    pg_clipfrac = verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    ppo_kl = verl_masked_mean(-negative_approx_kl, response_mask)
    return pg_loss, {
        "actor/pg_clipfrac": pg_clipfrac.item(),
        "actor/ppo_kl": ppo_kl.item(),
        "actor/pg_clipfrac_lower": 0.0,
    }


def verl_sapo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None):
    tau_pos = torch.as_tensor(config.tau_pos, dtype=advantages.dtype, device=advantages.device)
    tau_neg = torch.as_tensor(config.tau_neg, dtype=advantages.dtype, device=advantages.device)

    def gate_function(x, tau):
        return torch.sigmoid(tau * (x - 1.0)) * (4.0 / tau)

    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    taus = torch.where(condition=advantages > 0, input=tau_pos, other=tau_neg)
    pg_losses = -gate_function(ratio, taus) * advantages
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = verl_agg_loss(pg_losses, response_mask, "seq-mean-token-mean")
    ppo_kl = verl_masked_mean(-negative_approx_kl, response_mask)
    return pg_loss, {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": ppo_kl.item(), "actor/pg_clipfrac_lower": 0.0}


def verl_clip_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None):
    clip_cov_ratio = config.policy_loss.clip_cov_ratio
    cliprange_low, cliprange_high = config.clip_ratio_low, config.clip_ratio_high
    clip_cov_ub, clip_cov_lb = config.policy_loss.clip_cov_ub, config.policy_loss.clip_cov_lb
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    corr = torch.ones_like(advantages)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)
    cov_all = (advantages - verl_masked_mean(advantages, response_mask)) * (
        log_prob - verl_masked_mean(log_prob.detach(), response_mask)
    )
    cov_all[response_mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
    top_k_idx = (cov_all < clip_cov_ub) & (cov_all > clip_cov_lb) & (response_mask > 0)
    top_k_idx = torch.nonzero(top_k_idx)
    if len(top_k_idx) > 0:
        perm = torch.randperm(len(top_k_idx))
        top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))]]
    else:
        top_k_idx = torch.empty((0, 2), device=cov_all.device, dtype=torch.long)
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    pg_clipfrac = verl_masked_mean((corr == 0).float(), response_mask)
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, {"actor/pg_clipfrac": pg_clipfrac.item(), "actor/ppo_kl": ppo_kl.item()}


def verl_kl_cov(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None):
    kl_cov_ratio, ppo_kl_coef = config.policy_loss.kl_cov_ratio, config.policy_loss.ppo_kl_coef
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    ppo_kl_abs = verl_masked_mean(negative_approx_kl.abs(), response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = -advantages * ratio + ppo_kl_coef * abs_kl
    pg_losses = pg_losses1
    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = log_prob[all_valid].detach().reshape(-1).cpu()
    k = min(kl_cov_ratio, len(all_valid_adv))
    if k != 0:
        cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
        k_percent_nums = max(1, int(len(cov_lst_all) * kl_cov_ratio))
        large_cov_idxs = torch.topk(cov_lst_all, k_percent_nums, largest=True).indices
        if len(large_cov_idxs) != 0:
            large_cov_idxs = all_valid_idx[large_cov_idxs]
            pg_losses[large_cov_idxs // advantages.shape[1], large_cov_idxs % advantages.shape[1]] = pg_losses_kl[
                large_cov_idxs // advantages.shape[1], large_cov_idxs % advantages.shape[1]
            ]
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, {"actor/ppo_kl": ppo_kl_abs.item()}


def verl_geo_mean(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None):
    cliprange_low, cliprange_high = config.clip_ratio_low, config.clip_ratio_high
    negative_approx_kl = log_prob - old_log_prob
    ppo_kl = verl_masked_mean(-negative_approx_kl, response_mask)
    sgn_advantage = torch.sign(advantages)
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -cliprange_low, cliprange_high)
    negative_approx_kl_min = torch.min(sgn_advantage * negative_approx_kl, sgn_advantage * negative_approx_kl_clamp)
    negative_approx_kl_min = sgn_advantage * negative_approx_kl_min
    response_mask_sum = response_mask.sum(dim=-1)
    ratio = torch.exp((negative_approx_kl_min * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8))
    advantage = (advantages * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    pg_losses = -advantage * ratio
    if rollout_is_weights is not None:
        seq_is_weights = torch.exp(
            (torch.log(rollout_is_weights + 1e-10) * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
        )
        pg_losses = pg_losses * seq_is_weights
    pg_loss = torch.mean(pg_losses)
    clipped = torch.ne(negative_approx_kl, negative_approx_kl_clamp)
    pg_clipfrac = verl_masked_mean((clipped * (advantages > 0)).float(), response_mask)
    pg_clipfrac_lower = verl_masked_mean((clipped * (advantages < 0)).float(), response_mask)
    return pg_loss, {
        "actor/pg_clipfrac": pg_clipfrac.item(),
        "actor/ppo_kl": ppo_kl.item(),
        "actor/pg_clipfrac_lower": pg_clipfrac_lower.item(),
    }


def verl_cispo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None):
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_masked_mean(-negative_approx_kl, response_mask)
    clipped_ratio = torch.clamp(ratio, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
    pg_clipfrac = verl_masked_mean((ratio != clipped_ratio).float(), response_mask)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, {
        "actor/pg_clipfrac": pg_clipfrac.item(),
        "actor/ppo_kl": ppo_kl.item(),
        "actor/pg_clipfrac_lower": 0.0,
    }


def verl_dppo(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None, kind="tv"
):
    """verl 0.9.1's compute_policy_loss_dppo_tv / _dppo_kl (config.get("clip_ratio_c", 20.0) reads the
    actor's clip_ratio_c, 3.0 by default)."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_masked_mean(-negative_approx_kl, response_mask)
    truncated_ratio = torch.clamp(ratio, max=config.clip_ratio_c).detach()
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    if kind == "tv":
        valid_positive_mask = (prob - old_prob) <= config.clip_ratio_high
        valid_negative_mask = (prob - old_prob) >= -config.clip_ratio_low
    else:
        binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
        )
        valid_positive_mask = (binary_kl <= config.clip_ratio_high) | (prob <= old_prob)
        valid_negative_mask = (binary_kl <= config.clip_ratio_low) | (prob >= old_prob)
    valid_mask = torch.where(advantages > 0, valid_positive_mask, valid_negative_mask).detach().float()
    pg_losses = -advantages * truncated_ratio * log_prob * valid_mask
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    pg_clipfrac = verl_masked_mean((1.0 - valid_mask).float(), response_mask)
    pg_clipfrac_lower = verl_masked_mean((ratio > config.clip_ratio_c).float() * valid_mask, response_mask)
    return pg_loss, {
        "actor/pg_clipfrac": pg_clipfrac.item(),
        "actor/ppo_kl": ppo_kl.item(),
        "actor/pg_clipfrac_lower": pg_clipfrac_lower.item(),
    }


def verl_dro(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None):
    beta = config.policy_loss.dro_beta
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * beta * log_ratio.square())
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, {"actor/ppo_kl": verl_masked_mean(-log_ratio, response_mask).item()}


VERL = {
    "dppo_tv": lambda *a, **k: verl_dppo(*a, **k, kind="tv"),
    "dppo_kl": lambda *a, **k: verl_dppo(*a, **k, kind="kl"),
    "dro": verl_dro,
    "gspo": verl_gspo,
    "sapo": verl_sapo,
    "clip_cov": verl_clip_cov,
    "kl_cov": verl_kl_cov,
    "geo_mean": verl_geo_mean,
    "cispo": verl_cispo,
}


# ---------------------------------------------------------------------------------- helpers
def actor_cfg(mode="token-mean", low=0.2, high=0.28, **policy_loss):
    """The actor section as the losses read it (verl's defaults; the selections of clip_cov and
    kl_cov widened so that several tokens of a small batch are picked)."""
    pl = dict(clip_cov_ratio=0.2, clip_cov_lb=0.02, clip_cov_ub=3.0, kl_cov_ratio=0.2, ppo_kl_coef=0.5, dro_beta=0.3)
    pl.update(policy_loss)
    return SimpleNamespace(
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=3.0,
        loss_agg_mode=mode,
        tau_pos=1.0,
        tau_neg=1.05,
        policy_loss=SimpleNamespace(**pl),
    )


def random_batch(seed: int, B: int = 6, T: int = 9, dtype=torch.float64, holes: bool = False):
    """Right-padded rows; ``holes``: also a masked span inside some responses (a tool's turn)."""
    g = torch.Generator().manual_seed(seed)
    lp = (-2 * torch.rand(B, T, generator=g, dtype=dtype)).requires_grad_()
    old = lp.detach() + 0.4 * torch.randn(B, T, generator=g, dtype=dtype)
    seq_adv = torch.randn(B, 1, generator=g, dtype=dtype)  # sequence-level (GMPO's assumption), plus noise
    adv = seq_adv + 0.5 * torch.randn(B, T, generator=g, dtype=dtype)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(dtype)
    if holes:
        for r in range(0, B, 2):
            if lengths[r] >= 4:
                mask[r, 1:3] = 0.0
    w = 0.5 + torch.rand(B, T, generator=g, dtype=dtype)
    return old, lp, adv, mask, w


# ------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(6))
def test_each_loss_equals_verls_code_with_its_metrics_and_gradient(name, mode, seed):
    """verl 0.9.1's functions, on right-padded masks (seeds 0-2) and multi-turn masks (3-5)."""
    old, lp, adv, mask, w = random_batch(seed, holes=seed >= 3)
    cfg = actor_cfg(mode, low=10.0 if name == "cispo" else 0.2)
    for weights in (None, w):
        torch.manual_seed(seed)  # clip_cov draws its tokens with torch's global generator, as verl
        ours, metrics = POLICY_LOSSES[name](old, lp, adv, mask, cfg, is_weights=weights)
        torch.manual_seed(seed)
        ref, ref_metrics = VERL[name](old, lp, adv, mask, mode, cfg, rollout_is_weights=weights)
        torch.testing.assert_close(ours, ref, rtol=1e-7, atol=1e-9)
        assert {f"actor/{k}" for k in metrics} == set(ref_metrics)  # verl's names, prefixed by the actor
        for k, v in metrics.items():
            assert float(v) == pytest.approx(ref_metrics[f"actor/{k}"], rel=1e-6, abs=1e-9), k
        (g_ours,), (g_ref,) = torch.autograd.grad(ours, lp), torch.autograd.grad(ref, lp)
        torch.testing.assert_close(g_ours, g_ref, rtol=1e-7, atol=1e-9)


def test_the_batches_exercise_the_clips_and_the_selections():
    """The random batches above are not trivial: each clip and selection is active on them."""
    old, lp, adv, mask, _ = random_batch(0)
    cfg = actor_cfg()
    for name in ("gspo", "clip_cov", "geo_mean"):
        assert float(POLICY_LOSSES[name](old, lp, adv, mask, cfg)[1]["pg_clipfrac"]) > 0, name
    assert float(POLICY_LOSSES["cispo"](old, lp, adv, mask, actor_cfg(low=0.2))[1]["pg_clipfrac"]) > 0
    for name in ("dppo_tv", "dppo_kl"):  # tokens dropped, and kept tokens' ratios truncated at clip_ratio_c
        m = POLICY_LOSSES[name](old, lp, adv, mask, actor_cfg(low=0.02, high=0.02))[1]
        assert 0 < float(m["pg_clipfrac"]) < 1, name
    truncating = actor_cfg()
    truncating.clip_ratio_c = 1.2
    assert float(POLICY_LOSSES["dppo_tv"](old, lp, adv, mask, truncating)[1]["pg_clipfrac_lower"]) > 0
    unpenalised = POLICY_LOSSES["kl_cov"](old, lp, adv, mask, actor_cfg(ppo_kl_coef=0.0))[0]
    assert not torch.allclose(POLICY_LOSSES["kl_cov"](old, lp, adv, mask, cfg)[0], unpenalised)
    # with verl's defaults (a 0.0002 share: at least one token) the selections still pick one token each
    defaults = actor_cfg(
        **{
            k: getattr(ActorConfig().policy_loss, k)
            for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")
        }
    )
    for name in ("clip_cov", "kl_cov"):
        torch.manual_seed(0)
        ours = POLICY_LOSSES[name](old, lp, adv, mask, defaults)[0]
        torch.manual_seed(0)
        torch.testing.assert_close(ours, VERL[name](old, lp, adv, mask, "token-mean", defaults)[0])


@pytest.mark.parametrize("name", ["gspo", "sapo", "geo_mean", "cispo"])
@pytest.mark.parametrize("mode", MODES)
def test_split_micro_batches_with_global_counts_sum_to_the_whole(name, mode):
    """Where verl's loss is split-invariant (no per-batch selection), two micro-batches given the
    mini-batch's counts add up to the whole batch's loss and gradient. (clip_cov and kl_cov pick
    their tokens in the micro-batch they get, as verl: not split-invariant, by design.)"""
    old, lp, adv, mask, w = random_batch(5, B=7)
    cfg = actor_cfg(mode, low=10.0 if name == "cispo" else 0.2)
    tokens, seqs = global_batch_counts(mask)
    kw = dict(global_tokens=tokens, global_seqs=seqs, norm_const=9.0)
    whole = POLICY_LOSSES[name](old, lp, adv, mask, cfg, is_weights=w, **kw)[0]
    parts = sum(
        POLICY_LOSSES[name](old[s], lp[s], adv[s], mask[s], cfg, is_weights=w[s], **kw)[0]
        for s in (slice(0, 3), slice(3, 7))
    )
    torch.testing.assert_close(parts, whole)
    torch.testing.assert_close(torch.autograd.grad(parts, lp)[0], torch.autograd.grad(whole, lp)[0])


def test_the_entries_declare_what_their_clip_ratios_bound_and_the_keys_they_own():
    assert list(POLICY_LOSSES)[:3] == ["vanilla", "reinforce", "gpg"] and set(NEW) <= set(POLICY_LOSSES)
    assert POLICY_LOSSES["cispo"].clip is IS_WEIGHT and POLICY_LOSSES["geo_mean"].clip is LOG_RATIO
    assert all(POLICY_LOSSES[n].clip is PPO_RATIO for n in ("vanilla", "gspo", "clip_cov"))
    assert POLICY_LOSSES["clip_cov"].keys == (
        "policy_loss.clip_cov_ratio",
        "policy_loss.clip_cov_lb",
        "policy_loss.clip_cov_ub",
    )
    assert POLICY_LOSSES["kl_cov"].keys == ("policy_loss.kl_cov_ratio", "policy_loss.ppo_kl_coef")
    assert POLICY_LOSSES["sapo"].keys == ("tau_pos", "tau_neg")
    assert POLICY_LOSSES["dro"].keys == ("policy_loss.dro_beta",)
    assert POLICY_LOSSES["dppo_tv"].clip is DIVERGENCE and POLICY_LOSSES["dppo_kl"].clip is DIVERGENCE
    # verl 0.9.1's defaults (PolicyLossConfig / ActorConfig; its rollout_correction is
    # algorithm.rollout_correction here)
    assert vars(ActorConfig().policy_loss) == dict(
        loss_mode="vanilla",
        clip_cov_ratio=0.0002,
        clip_cov_lb=1.0,
        clip_cov_ub=5.0,
        kl_cov_ratio=0.0002,
        ppo_kl_coef=0.1,
        dro_beta=None,
    )
    assert (ActorConfig().tau_pos, ActorConfig().tau_neg) == (1.0, 1.05)


@pytest.mark.parametrize(
    "loss, key, value",
    [
        ("clip_cov", "policy_loss.clip_cov_ratio", "0.001"),
        ("clip_cov", "policy_loss.clip_cov_lb", "0.5"),
        ("clip_cov", "policy_loss.clip_cov_ub", "4.0"),
        ("kl_cov", "policy_loss.kl_cov_ratio", "0.002"),
        ("kl_cov", "policy_loss.ppo_kl_coef", "1.0"),
        ("sapo", "tau_pos", "2.0"),
        ("sapo", "tau_neg", "1.5"),
    ],
)
def test_a_key_of_one_loss_is_refused_when_another_is_selected(loss, key, value):
    cfg, _ = load_config("tiny_klppo", [f"{KEY}policy_loss.loss_mode={loss}", f"{KEY}{key}={value}"])
    assert str(cfg.actor_rollout_ref.actor.policy_loss.loss_mode) == loss
    for other in ("vanilla", "gspo"):
        with pytest.raises(
            ConfigError,
            match=rf"{KEY}{key}={value} is read only by policy_loss.loss_mode={loss}, "
            rf"but the selected loss is {other}",
        ):
            load_config("tiny_klppo", [f"{KEY}policy_loss.loss_mode={other}", f"{KEY}{key}={value}"])
    # at its default the key is accepted with any loss (verl's scripts spell defaults out)
    default = ActorConfig()
    for part in key.split("."):
        default = getattr(default, part)
    load_config("tiny_klppo", [f"{KEY}policy_loss.loss_mode=vanilla", f"{KEY}{key}={default}"])


def test_the_clip_ratio_ranges_follow_what_the_selected_loss_clips():
    cfg, _ = load_config(
        "tiny_klppo", [f"{KEY}policy_loss.loss_mode=cispo", f"{KEY}clip_ratio_low=10", f"{KEY}clip_ratio_high=0.2"]
    )  # verl's examples/cispo_trainer
    assert cfg.actor_rollout_ref.actor.clip_ratio_low == 10
    load_config("tiny_klppo", [f"{KEY}policy_loss.loss_mode=geo_mean", f"{KEY}clip_ratio_low=1.5"])
    for loss in ("vanilla", "gspo", "clip_cov"):
        with pytest.raises(
            ConfigError,
            match=rf"clip_ratio_low \(10.0\) must be in \[0, 1\) with "
            rf"policy_loss.loss_mode={loss}: it bounds PPO's ratio",
        ):
            load_config("tiny_klppo", [f"{KEY}policy_loss.loss_mode={loss}", f"{KEY}clip_ratio_low=10"])
    with pytest.raises(ConfigError, match=r"clip_ratio_low \(-0.1\) must be >= 0 with policy_loss.loss_mode=cispo"):
        load_config("tiny_klppo", [f"{KEY}policy_loss.loss_mode=cispo", f"{KEY}clip_ratio_low=-0.1"])


@pytest.mark.parametrize("name", NEW)
def test_each_loss_trains_through_the_actor_with_its_metrics(name):
    """The actor calls the entry with its config section and the mini-batch's counts: where the loss
    is split-invariant, two micro-batches give the gradient of one; every metric is logged as
    ``actor/<name>``."""
    b = skewed_batch(n=6)
    results = []
    for micro in (6, 2):
        model = build_causal_lm("tiny://qwen2?vocab_size=256", torch.float32, seed=0)  # (the batch's ids are < 256)
        cfg = ActorConfig(
            ppo_micro_batch_size_per_gpu=micro, clip_ratio_low=10.0 if name == "cispo" else 0.2, clip_ratio_high=0.28
        )
        cfg.policy_loss.loss_mode = name
        cfg.policy_loss.dro_beta = 0.3 if name == "dro" else None
        actor = Actor(model, cfg, ActorSpec(remove_padding=True, optimizer=build_optimizer(model, cfg.optim)))
        lp, _ = actor.compute_log_prob(b, 6, False, 10_000)
        batch = dict(
            b,
            old_log_probs=lp
            + 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(1)) * b["response_mask"],
        )
        torch.manual_seed(0)
        metrics = actor.update_policy(batch, mini_batch_rows=6)
        results.append(grads_of(model))
        _, own = POLICY_LOSSES[name](batch["old_log_probs"], lp, b["advantages"], b["response_mask"], cfg)
        assert {f"actor/{k}" for k in own} <= set(metrics), (sorted(own), sorted(metrics))
        assert torch.isfinite(results[-1]).all()  # (one flat tensor: not a Python loop over its elements)
    if name not in ("clip_cov", "kl_cov"):
        torch.testing.assert_close(results[0], results[1], atol=1e-6, rtol=1e-5)


def test_dro_needs_its_beta_and_bypass_mode_needs_bypass_at_the_dry_run():
    with pytest.raises(
        ConfigError, match=r"policy_loss.dro_beta=None: policy_loss.loss_mode=dro needs a positive beta"
    ):
        load_config("tiny_klppo", [f"{KEY}policy_loss.loss_mode=dro"])
    cfg, _ = load_config("tiny_klppo", [f"{KEY}policy_loss.loss_mode=dro", f"{KEY}policy_loss.dro_beta=0.1"])
    assert cfg.actor_rollout_ref.actor.policy_loss.dro_beta == 0.1
    with pytest.raises(ConfigError, match=r"policy_loss.dro_beta=0.1 is read only by policy_loss.loss_mode=dro"):
        load_config("tiny_klppo", [f"{KEY}policy_loss.dro_beta=0.1"])
    with pytest.raises(
        ConfigError,
        match=r"loss_mode=bypass_mode is the loss of algorithm.rollout_correction."
        r"bypass_mode=true",
    ):
        load_config("tiny_klppo", [f"{KEY}policy_loss.loss_mode=bypass_mode"])
    load_config(
        "tiny_klppo", [f"{KEY}policy_loss.loss_mode=bypass_mode", "algorithm.rollout_correction.bypass_mode=true"]
    )
    cfg, _ = load_config("tiny_klppo", [f"{KEY}loss_agg_mode=token-sum"])
    assert cfg.actor_rollout_ref.actor.loss_agg_mode == "token-sum"


def test_bypass_mode_is_ppos_clipped_ratio_with_the_weights_reported_not_applied():
    """verl's bypass_mode loss with loss_type ppo_clip: vanilla PPO against the engine's log-probs,
    the IS weights not applied (the ratio is already current / engine)."""
    old, lp, adv, mask, w = random_batch(2, holes=True)
    cfg = actor_cfg("token-mean")
    ours, m = POLICY_LOSSES["bypass_mode"](old, lp, adv, mask, cfg, is_weights=w)
    ref, ref_m = POLICY_LOSSES["vanilla"](old, lp, adv, mask, cfg)
    torch.testing.assert_close(ours, ref)
    assert m.keys() == ref_m.keys()
