"""Correcting the rollout/actor mismatch: truncated importance sampling (IS) and rejection sampling
(RS) of the engine's samples, with verl's formulas, keys and metric names
(``algorithm.rollout_correction``; verl's ``rollout_corr_helper.py`` as of 0.9.1).

The engine samples from pi_rollout (its own kernels, its own precision); the actor trains pi_old.
With ``log_ratio = log pi_old - log pi_rollout`` per response token (B, R):

- IS (``rollout_is``): the raw weight, ``token``: exp(clip(r_t, -20, 20)); ``sequence``: the row's
  exp(clip(sum_t r_t, -20, 20)) broadcast over its tokens. ``rollout_is_threshold`` C caps it at C
  (truncated IS), or ``"lower_upper"`` zeroes it outside [lower, upper] (IcePop). Zero off the
  mask, detached; ``rollout_is_batch_normalize`` divides by the batch mean of the applied weights.
  The weights multiply the per-token PPO loss after clipping. The metrics describe the applied
  weights, except the fractions above/below the bounds, which count the raw ones (verl 0.9.1).
- RS (``rollout_rs``, a comma-separated list, every option must pass): statistics of
  k1 = -r, k2 = r^2 / 2, k3 = exp(r) - 1 - r per token (``token_*``) or per row (``seq_sum_*``,
  ``seq_mean_*``, ``seq_max_*``); a rejected token (or row) leaves the response mask, so it drops out
  of advantages, critic and actor losses. k1 thresholds are ``"lower_upper"`` (or one upper u,
  lower 1/u) compared in log space with k1, as verl does: kept when log(lower) <= k1 <= log(upper).
  k2/k3 take one upper bound.

IS and RS are computed from the same ratios and the original mask, independently. What padding
holds (NaN, -inf) never reaches a figure: masked sums select with ``torch.where``. Every statistic
is global over ranks (``all_reduce_sum``/``all_reduce_max``): N ranks give the numbers one process
gives on the whole batch, as verl's driver computes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

__all__ = ["RS_OPTIONS", "parse_is_threshold", "parse_rejection", "rollout_correction"]

SAFETY_BOUND = 20.0
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
Reduce = Optional[Callable[[torch.Tensor], torch.Tensor]]


@dataclass(frozen=True)
class RejectionOption:
    name: str  # one of RS_OPTIONS
    upper: float
    lower: Optional[float]  # k1 options only

    @property
    def token_level(self) -> bool:
        return self.name.startswith("token_")


def parse_is_threshold(threshold) -> tuple[float, Optional[float]]:
    """``rollout_is_threshold`` -> (upper, lower): one number caps the weights at it (lower None);
    ``"lower_upper"`` is IcePop's window. ValueError naming what is wrong (verl's rules)."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, str)):
        raise ValueError(
            f"rollout_is_threshold={threshold!r}: give a number (a cap, e.g. 2.0) or "
            f"'lower_upper' (IcePop's window, e.g. 0.5_2.0)"
        )
    spec = str(threshold).strip()
    try:
        lower, upper = (float(x) for x in spec.split("_", 1)) if "_" in spec else (None, float(spec))
    except ValueError:
        raise ValueError(
            f"rollout_is_threshold='{spec}' is not a number or 'lower_upper' (e.g. 2.0 or 0.5_2.0)"
        ) from None
    if upper <= 0 or (lower is not None and lower <= 0):
        raise ValueError(f"rollout_is_threshold='{spec}': bounds must be > 0 (verl's default 2.0; 2-5 is usual)")
    if lower is not None and lower > upper:
        raise ValueError(
            f"rollout_is_threshold='{spec}': lower {lower} is above upper {upper}, a window that keeps "
            f"no weight; write it lower_upper (e.g. {upper}_{lower})"
        )
    return upper, lower


def parse_rejection(rollout_rs: Optional[str], threshold) -> list[RejectionOption]:
    """``rollout_rs`` and ``rollout_rs_threshold`` -> the options; ValueError naming what is wrong.

    A threshold is one entry per option (comma-separated) or one for all; a k1 option takes
    ``"lower_upper"`` or one upper ``u`` (lower 1/u), both > 0; k2/k3 one positive upper bound.
    """
    if rollout_rs is None:
        return []
    names = list(dict.fromkeys(o.strip() for o in str(rollout_rs).split(",") if o.strip()))
    if not names:
        raise ValueError("rollout_rs names no option")
    bad = [n for n in names if n not in RS_OPTIONS]
    if bad:
        raise ValueError(
            f"rollout_rs: unknown option {', '.join(bad)}; choose from {', '.join(RS_OPTIONS)} "
            f"(verl's older 'token'/'sequence'/'geometric' are token_k1/seq_sum_k1/seq_mean_k1)"
        )
    if threshold is None:
        raise ValueError(
            "rollout_rs is set but rollout_rs_threshold is not: give a bound per option "
            "(e.g. rollout_rs=seq_mean_k3 rollout_rs_threshold=0.01, or seq_sum_k1 with '0.5_2.0')"
        )
    specs = (
        [str(threshold)]
        if isinstance(threshold, (int, float))
        else [p.strip() for p in str(threshold).split(",") if p.strip()]
    )
    if len(specs) not in (1, len(names)):
        raise ValueError(
            f"rollout_rs_threshold has {len(specs)} entries for {len(names)} options: give one, "
            f"or one per option in the order of rollout_rs"
        )
    specs = specs * len(names) if len(specs) == 1 else specs
    options = []
    for name, spec in zip(names, specs):
        try:
            if name.endswith("k1"):
                lo_s, up_s = spec.split("_", 1) if "_" in spec else (None, spec)
                upper = float(up_s)
                lower = float(lo_s) if lo_s is not None else 1.0 / upper
            elif "_" in spec:
                raise ValueError(
                    f"rollout_rs_threshold '{spec}' for {name}: k2/k3 take one upper bound, not 'lower_upper'"
                )
            else:
                upper, lower = float(spec), None
        except (ValueError, ZeroDivisionError) as e:
            if "k2/k3" in str(e):
                raise
            raise ValueError(
                f"rollout_rs_threshold '{spec}' for {name} is not a number"
                + (" or 'lower_upper'" if name.endswith("k1") else "")
            ) from None
        if upper <= 0 or (lower is not None and lower <= 0):
            raise ValueError(f"rollout_rs_threshold '{spec}' for {name}: bounds must be positive")
        if lower is not None and lower > upper:
            raise ValueError(
                f"rollout_rs_threshold '{spec}' for {name}: lower {lower:g} is above upper {upper:g}, "
                f"a window that keeps no token; write it lower_upper with lower <= upper"
                + ("" if "_" in spec else " (one value u means the window [1/u, u]: give u >= 1)")
            )
        options.append(RejectionOption(name, upper, lower))
    return options


# --------------------------------------------------------------------------- global reductions
class _Global:
    """Sums, means, extremes and standard deviations over every rank's rows (float64)."""

    def __init__(self, all_reduce_sum: Reduce, all_reduce_max: Reduce):
        self.sum_, self.max_ = all_reduce_sum, all_reduce_max

    def sum(self, *xs: torch.Tensor) -> list[float]:
        t = torch.stack([x.double().sum() for x in xs])
        if self.sum_ is not None:
            t = self.sum_(t)
        return t.tolist()

    def max(self, x: torch.Tensor, keep: torch.Tensor) -> float:
        local = x.double()[keep].max() if keep.any() else torch.tensor(-math.inf, dtype=torch.float64)
        if self.max_ is not None:
            local = self.max_(local.reshape(1))[0]
        return float(local)

    def min(self, x: torch.Tensor, keep: torch.Tensor) -> float:
        return -self.max(-x, keep)

    def masked_mean(self, x: torch.Tensor, mask: torch.Tensor) -> float:
        s, n = self.sum(_masked(x, mask), mask)
        return s / (n + 1e-8)

    def mean(self, x: torch.Tensor) -> float:
        s, n = self.sum(x, torch.ones_like(x))
        return s / n if n else 0.0

    def std(self, x: torch.Tensor) -> float:
        """Unbiased (n - 1), as torch.std."""
        s, s2, n = self.sum(x, x * x, torch.ones_like(x))
        return math.sqrt(max(0.0, (s2 - s * s / n) / (n - 1))) if n > 1 else 0.0

    def clamped_std(self, x: torch.Tensor, mask: torch.Tensor, lo: float, hi: float) -> float:
        c = _masked(x.clamp(min=lo, max=hi), mask)
        s, s2, n = self.sum(c, c * c, mask)
        if n <= 1:
            return 0.0
        mean = s / (n + 1e-8)
        return math.sqrt(max(0.0, s2 / (n + 1e-8) - mean * mean))


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x * mask, with whatever sits off the mask (NaN, inf) replaced by 0 first: 0 * NaN is NaN."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device)) * mask


def _masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _masked(x, mask).sum(-1)


def _masked_row_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _masked(x, mask).sum(-1) / (mask.sum(-1) + 1e-8)


# ------------------------------------------------------------------------------ IS weights
def importance_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    threshold,
    batch_normalize: bool = False,
    g: Optional[_Global] = None,
    with_metrics: bool = True,
) -> tuple[torch.Tensor, dict]:
    """IS weights (B, R), truncated at ``threshold`` or IcePop's ``"lower_upper"`` window, detached
    and zero off the mask, and their metrics (verl's ``rollout_is_*``). ``level``: ``token`` or
    ``sequence``."""
    g = g or _Global(None, None)
    upper, lower = parse_is_threshold(threshold)
    if level == "token":
        for_metrics = log_ratio
        w = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    elif level == "sequence":
        for_metrics = _masked_sum(log_ratio, mask).unsqueeze(-1)
        w = torch.exp(for_metrics.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    else:
        raise ValueError(f"rollout_is must be 'token' or 'sequence', got {level!r}")
    raw = _masked(w, mask)
    if lower is None:
        w = raw.clamp(max=upper)
    else:
        outside = (raw < lower) | (raw > upper)
        w = torch.where(outside, torch.zeros_like(raw), raw)
    metrics = _importance_metrics(w, raw, for_metrics, mask, level, upper, lower, g) if with_metrics else {}
    if with_metrics and lower is not None:
        metrics["rollout_is_oob_ratio"] = g.masked_mean(outside.double(), mask)
    w = w.detach()
    if batch_normalize:
        if level == "token":
            mean = g.masked_mean(w, mask)
        else:
            has = (mask.sum(-1) > 0).to(w.dtype)
            s, n = g.sum(_masked_row_mean(w, mask) * has, has)
            mean = s / max(n, 1e-8)
        if mean > 1e-8:
            w = w / mean
        metrics["rollout_is_batch_norm_factor"] = mean if mean > 1e-8 else 1.0
    return w, metrics


def _importance_metrics(
    w: torch.Tensor,
    raw: torch.Tensor,
    for_metrics: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    threshold: float,
    lower: Optional[float],
    g: _Global,
) -> dict:
    """Of the applied weights ``w``; the fractions beyond the bounds count the ``raw`` ones (a capped
    weight never exceeds the cap)."""
    lower = 1.0 / threshold if lower is None else lower
    m: dict = {"rollout_is_mean": g.masked_mean(w, mask)}
    if level == "sequence":
        rows = torch.ones(for_metrics.shape[0], dtype=torch.bool, device=for_metrics.device)
        r = for_metrics.squeeze(-1)
        m["rollout_is_max"] = math.exp(min(g.max(r, rows), SAFETY_BOUND))
        m["rollout_is_min"] = math.exp(g.min(r, rows))
        m["rollout_is_ratio_fraction_high"] = g.mean((r > math.log(threshold)).double())
        m["rollout_is_ratio_fraction_low"] = g.mean((r < math.log(lower)).double())
    else:
        keep = mask.bool()
        m["rollout_is_ratio_fraction_high"] = g.masked_mean((raw > threshold).double(), mask)
        m["rollout_is_ratio_fraction_low"] = g.masked_mean((raw < lower).double(), mask)
        m["rollout_is_max"] = g.max(w, keep)
        m["rollout_is_min"] = g.min(w, keep)
    m["rollout_is_std"] = g.clamped_std(w, mask, 0.0, threshold)
    clamped = w.clamp(min=0.0, max=threshold)
    normalised = clamped / (g.masked_mean(clamped, mask) + 1e-8)
    second_moment = g.masked_mean(normalised * normalised, mask)
    # every weight zeroed (IcePop's window rejects the whole batch): no effective sample, and the step
    # trains nothing on those rows rather than dividing by zero (verl 0.9.1 raises here)
    m["rollout_is_eff_sample_size"] = 1.0 / second_moment if second_moment > 0 else 0.0
    seq = _masked_row_mean(w, mask)
    rows = torch.ones_like(seq, dtype=torch.bool)
    m["rollout_is_seq_mean"] = g.mean(seq)
    m["rollout_is_seq_std"] = g.std(seq)
    m["rollout_is_seq_max"] = g.max(seq, rows)
    m["rollout_is_seq_min"] = g.min(seq, rows)
    m["rollout_is_seq_max_deviation"] = g.max((seq - 1.0).abs(), rows)
    raw_seq = _masked_row_mean(raw, mask)
    m["rollout_is_seq_fraction_high"] = g.mean((raw_seq > threshold).double())
    m["rollout_is_seq_fraction_low"] = g.mean((raw_seq < lower).double())
    return m


# ------------------------------------------------------------------------- rejection sampling
def rejection_mask(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    options: list[RejectionOption],
    g: Optional[_Global] = None,
    with_metrics: bool = True,
) -> tuple[torch.Tensor, dict]:
    """The response mask with rejected tokens (or whole rows) removed (B, R), and verl's
    ``rollout_rs_*`` metrics."""
    g = g or _Global(None, None)
    r = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    stats = {"k1": -r, "k2": 0.5 * r * r, "k3": torch.exp(r) - 1.0 - r}
    valid, seq_valid = mask.bool(), mask.sum(-1) > 0
    combined = torch.ones_like(mask, dtype=log_ratio.dtype)
    metrics: dict = {}
    for opt in options:
        token_stat = stats[opt.name[-2:]]
        k1 = opt.name.endswith("k1")
        upper = math.log(opt.upper) if k1 else opt.upper
        lower = math.log(opt.lower) if k1 else None
        if opt.token_level:
            stat, seq_stat = token_stat, None
        else:
            if opt.name.startswith("seq_sum"):
                seq_stat = _masked_sum(token_stat, mask)
            elif opt.name.startswith("seq_mean"):
                seq_stat = _masked_row_mean(token_stat, mask)
            else:  # seq_max; an empty row's maximum is 0
                masked = token_stat.masked_fill(~valid, -math.inf).max(-1).values
                seq_stat = torch.where(masked == -math.inf, torch.zeros_like(masked), masked)
            stat = seq_stat.unsqueeze(-1).expand_as(mask)
        keep = stat <= upper if lower is None else (stat >= lower) & (stat <= upper)
        keep_f = keep.to(log_ratio.dtype)
        combined = combined * keep_f
        if not with_metrics:
            continue
        metrics.update(
            _rejection_metrics(
                opt.name,
                stat,
                seq_stat,
                mask,
                seq_valid,
                upper,
                lower if lower is not None else 0.0,
                lower is not None,
                g,
            )
        )
        row_kept = (~(~keep & valid)).all(-1)
        metrics[f"rollout_rs_{opt.name}_masked_fraction"] = g.masked_mean(1 - keep_f, mask)
        s, n = g.sum((~row_kept & seq_valid).double(), seq_valid.double())
        metrics[f"rollout_rs_{opt.name}_seq_masked_fraction"] = s / n if n > 0 else 0.0
    if with_metrics:
        metrics["rollout_rs_masked_fraction"] = g.masked_mean(1 - combined, mask)
        metrics["rollout_rs_seq_masked_fraction"] = g.mean((~((combined > 0.5) & valid) & valid).any(-1).double())
    return (mask * combined).to(mask.dtype), metrics


def _rejection_metrics(
    name: str,
    stat: torch.Tensor,
    seq_stat: Optional[torch.Tensor],
    mask: torch.Tensor,
    seq_valid: torch.Tensor,
    upper: float,
    lower: float,
    with_lower: bool,
    g: _Global,
) -> dict:
    p = f"rollout_rs_{name}"
    seq = seq_stat if seq_stat is not None else _masked_row_mean(stat, mask)
    n_valid_rows = g.sum(seq_valid.double())[0]
    m = {f"{p}_mean": g.masked_mean(stat, mask)}
    if seq_stat is not None and n_valid_rows > 0:
        m[f"{p}_max"], m[f"{p}_min"] = g.max(seq, seq_valid), g.min(seq, seq_valid)
        s, n = g.sum((seq > upper).double() * seq_valid, seq_valid.double())
        m[f"{p}_fraction_high"] = s / n
        s, n = g.sum((seq < lower).double() * seq_valid, seq_valid.double())
        m[f"{p}_fraction_low"] = s / n if with_lower else 0.0
    else:
        keep = mask.bool()
        m[f"{p}_max"], m[f"{p}_min"] = g.max(stat, keep), g.min(stat, keep)
        m[f"{p}_fraction_high"] = g.masked_mean((stat > upper).double(), mask)
        m[f"{p}_fraction_low"] = g.masked_mean((stat < lower).double(), mask) if with_lower else 0.0
    m[f"{p}_std"] = g.clamped_std(stat, mask, lower if with_lower else 0.0, upper)
    if n_valid_rows > 0:
        sv = seq[seq_valid]
        ones = torch.ones_like(sv, dtype=torch.bool)
        m[f"{p}_seq_mean"] = g.mean(sv)
        m[f"{p}_seq_std"] = g.std(sv)
        m[f"{p}_seq_max"], m[f"{p}_seq_min"] = g.max(sv, ones), g.min(sv, ones)
        m[f"{p}_seq_max_deviation"] = g.max(sv.abs(), ones)
        m[f"{p}_seq_fraction_high"] = g.mean((sv > upper).double())
        if with_lower:
            m[f"{p}_seq_fraction_low"] = g.mean((sv < lower).double())
    else:
        for k in ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high") + (
            ("seq_fraction_low",) if with_lower else ()
        ):
            m[f"{p}_{k}"] = 0.0
    return m


# ------------------------------------------------------------------------ off-policy metrics
def off_policy_metrics(
    train_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor, g: Optional[_Global] = None
) -> dict:
    """How far the trained policy is from the one that sampled (verl's ``compute_offpolicy_metrics``):
    ``kl`` (k1, mean of rollout - train), ``k3_kl``, perplexities, ``chi2_token``/``chi2_seq``."""
    g = g or _Global(None, None)
    train_row, rollout_row = _masked_row_mean(train_lp, mask), _masked_row_mean(rollout_lp, mask)
    log_ratio = train_lp - rollout_lp
    diff = rollout_row - train_row
    rows = torch.ones_like(diff, dtype=torch.bool)
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    seq_sum = _masked_sum(log_ratio, mask).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": g.mean(torch.exp(-train_row)),
        "training_log_ppl": g.mean(-train_row),
        "kl": g.masked_mean(rollout_lp - train_lp, mask),
        "k3_kl": g.masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask),
        "rollout_ppl": g.mean(torch.exp(-rollout_row)),
        "rollout_log_ppl": g.mean(-rollout_row),
        "log_ppl_diff": g.mean(diff),
        "log_ppl_abs_diff": g.mean(diff.abs()),
        "log_ppl_diff_max": g.max(diff, rows),
        "log_ppl_diff_min": g.min(diff, rows),
        "ppl_ratio": g.mean(torch.exp(diff)),
        "chi2_token": g.masked_mean(rho * rho, mask) - 1.0,
        "chi2_seq": g.mean(torch.exp(2.0 * seq_sum)) - 1.0,
    }


# ---------------------------------------------------------------------------------- together
def rollout_correction(
    train_lp: torch.Tensor,
    rollout_lp: torch.Tensor,
    mask: torch.Tensor,
    cfg,
    all_reduce_sum: Reduce = None,
    all_reduce_max: Reduce = None,
    with_metrics: bool = True,
) -> tuple[Optional[torch.Tensor], torch.Tensor, dict]:
    """IS weights (or None), the response mask after rejection, and every ``rollout_corr/`` metric.

    Args: train_lp (log pi_old, or the current policy's in bypass mode), rollout_lp (the engine's),
    mask: (B, R). ``cfg``: ``algorithm.rollout_correction``. Every figure is global over ranks;
    ``with_metrics=False`` (a micro-batch of bypass mode) computes weights and mask only, whose one
    collective is the batch mean of ``rollout_is_batch_normalize``.
    """
    if mask.dtype == torch.bool:
        mask = mask.to(train_lp.dtype)
    g = _Global(all_reduce_sum, all_reduce_max)
    mask64 = mask.double()
    # what padding holds (NaN, -inf from an engine) must not reach a weight, a statistic or a mask
    train_lp, rollout_lp = (_masked(x.detach().double(), mask64) for x in (train_lp, rollout_lp))
    log_ratio = train_lp - rollout_lp
    weights, metrics = None, {}
    if cfg.rollout_is is not None:
        weights, m = importance_weights(
            log_ratio, mask64, cfg.rollout_is, cfg.rollout_is_threshold, cfg.rollout_is_batch_normalize, g, with_metrics
        )
        weights = weights.to(torch.float32)
        metrics.update(m)
    new_mask = mask
    options = parse_rejection(cfg.rollout_rs, cfg.rollout_rs_threshold)
    if options:
        new_mask, m = rejection_mask(log_ratio, mask64, options, g, with_metrics)
        new_mask = new_mask.to(mask.dtype)
        metrics.update(m)
    if with_metrics:
        metrics.update(off_policy_metrics(train_lp, rollout_lp, mask64, g))
    return weights, new_mask, {f"rollout_corr/{k}": float(v) for k, v in metrics.items()}
