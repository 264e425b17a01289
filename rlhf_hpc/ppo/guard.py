"""Stability guard: after each step, decide whether training diverged; if so, the trainer rolls
back to the last good checkpoint with a smaller learning rate (and optionally a stronger KL pull).

Checks (``trainer.guard``): non-finite losses or gradient norms; KL(actor || reference) above
``max_kl``; KL above ``kl_rise_threshold`` for ``kl_rise_steps`` steps in a row; value loss more
than ``vf_jump_factor`` times the median of the last ``window`` steps *and* above what a critic
predicting 0 would lose on the step's returns (``value_loss_floor``), so a tiny, noisy value loss
(0.001 -> 0.014 in the CPU demo) is not taken for a divergence. Two more need no threshold for the
model at hand: the rollouts' entropy falling to ``entropy_drop`` x its recent median (a policy
collapsed onto a few tokens: 4.14 -> 0.0 in one step of the demo at LR 10), and KL jumping to
``kl_jump_factor`` x its recent median and past ``kl_jump_floor`` (0 -> 4.2 there; a healthy
run's KL grows over many steps, 1.3x at most between neighbours in BENCHMARKS.md's real run).

Which checkpoint a trip goes back to: the loss and gradient checks see this step's own update, so
the last checkpoint before this step is good; the rollout checks (KL, entropy) see what the
*previous* update did to the policy, so the checkpoint saved right after that update is not
(``StabilityGuard.lag``). Every rank sees the same (globally reduced) metrics, so every rank takes
the same decision.
"""

from __future__ import annotations

import math
import statistics
from typing import Optional

from rlhf_hpc.config.schema import GuardConfig

__all__ = ["GuardStop", "StabilityGuard", "WATCHED_FINITE", "value_loss_floor"]

WATCHED_FINITE = (
    "actor/pg_loss",
    "actor/grad_norm",
    "critic/vf_loss",
    "critic/grad_norm",
    "actor/kl_loss",
    "actor/entropy",
    "critic/score/mean",
    "actor/ref_kl_mean",
)


class GuardStop(RuntimeError):
    """The guard's final stop: training diverged again after ``max_rollbacks`` rollbacks (or with no
    good checkpoint to go back to). Every rank raises it at the same step; the launcher ends the run
    with one line and exit code 3 (``rlhf_hpc.launch.failure.GUARD_STOP``)."""


def value_loss_floor(m: dict[str, float]) -> float:
    """The largest value loss (0.5 x squared error) a critic that outputs 0 could have on this
    step's returns: 0.5 x max |return|^2. A healthy critic stays below it; 0 when the step's
    returns are unknown (then the relative check alone decides)."""
    top = max(abs(m.get("critic/returns/max", 0.0)), abs(m.get("critic/returns/min", 0.0)))
    return 0.5 * top * top


class StabilityGuard:
    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self.rollbacks = 0
        self.lr_scale = 1.0
        self.kl_scale = 1.0
        self._kl_run = 0
        self._vf: list[float] = []
        self._entropy: list[float] = []
        self._kl: list[float] = []
        # steps before the tripping one whose checkpoints the trip distrusts (rollout checks: 1)
        self.lag = 0

    def check(self, m: dict[str, float]) -> Optional[str]:
        """The reason this step's metrics are divergent, or None."""
        c = self.cfg
        if not c.enable:
            return None
        self.lag = 0
        for key in WATCHED_FINITE:
            if key in m and not math.isfinite(m[key]):
                return f"{key} is {m[key]}"
        if m.get("actor/grad_norm_nonfinite", 0) > 0:
            return "non-finite actor gradient (the optimizer step was skipped)"
        reason = self._rollout_checks(m)
        if reason is not None:
            self.lag = 1
            return reason
        vf = m.get("critic/vf_loss")
        if vf is not None and c.vf_jump_factor is not None:
            if len(self._vf) >= c.window:
                median = statistics.median(self._vf[-c.window :])
                floor = value_loss_floor(m)
                # a jump only counts when the loss is also worse than a critic that predicts 0
                # everywhere: small, noisy value losses jump by 10x without anything diverging
                if vf > c.vf_jump_factor * median and vf > floor:
                    return (
                        f"critic/vf_loss {vf:.4g} > {c.vf_jump_factor} x the median of the last {c.window} "
                        f"steps ({median:.4g}) and > {floor:.4g}, the loss of predicting 0 for returns "
                        f"up to {max(abs(m.get('critic/returns/max', 0.0)), abs(m.get('critic/returns/min', 0.0))):.4g}"
                    )
            self._vf.append(vf)
        return None

    def _rollout_checks(self, m: dict[str, float]) -> Optional[str]:
        """The checks on this step's rollouts (what the previous update made of the policy)."""
        c = self.cfg
        kl = m.get("actor/ref_kl_mean")
        if kl is not None and c.max_kl is not None and kl > c.max_kl:
            return f"KL(actor || reference) {kl:.4g} > trainer.guard.max_kl={c.max_kl}"
        if kl is not None and c.kl_rise_threshold is not None:
            self._kl_run = self._kl_run + 1 if kl > c.kl_rise_threshold else 0
            if self._kl_run >= c.kl_rise_steps:
                return (
                    f"KL {kl:.4g} above trainer.guard.kl_rise_threshold={c.kl_rise_threshold} for {self._kl_run} steps"
                )
        entropy = m.get("actor/entropy")
        if entropy is not None and c.entropy_drop is not None and self._entropy:
            level = statistics.median(self._entropy[-c.window :])
            if entropy < c.entropy_drop * level:
                return (
                    f"actor/entropy {entropy:.4g} < trainer.guard.entropy_drop={c.entropy_drop} x its median "
                    f"over the last {len(self._entropy[-c.window :])} steps ({level:.4g}): the policy collapsed"
                )
        if kl is not None and c.kl_jump_factor is not None and self._kl:
            level = statistics.median(self._kl[-c.window :])
            if kl > max(c.kl_jump_factor * level, c.kl_jump_floor):
                return (
                    f"KL(actor || reference) {kl:.4g} jumped past trainer.guard.kl_jump_factor={c.kl_jump_factor} "
                    f"x its median over the last {len(self._kl[-c.window :])} steps ({level:.4g}) and "
                    f"trainer.guard.kl_jump_floor={c.kl_jump_floor}"
                )
        if entropy is not None:
            self._entropy.append(entropy)
        if kl is not None:
            self._kl.append(kl)
        return None

    def trip(self, reason: str) -> str:
        """Count a rollback and tighten the knobs; raises after ``max_rollbacks``."""
        self.rollbacks += 1
        if self.rollbacks > self.cfg.max_rollbacks:
            raise GuardStop(
                f"stability guard: {reason}; stopping after {self.cfg.max_rollbacks} rollbacks "
                f"(trainer.guard.max_rollbacks). Lower the learning rate or raise the KL coefficient."
            )
        self.lr_scale *= self.cfg.lr_decay
        self.kl_scale *= self.cfg.kl_coef_mult
        self._kl_run, self._vf, self._entropy, self._kl = 0, [], [], []
        return (
            f"stability guard tripped: {reason}; rolling back (#{self.rollbacks}), actor LR x{self.lr_scale:g}, "
            f"KL coefficient x{self.kl_scale:g}"
        )

    def state_dict(self) -> dict:
        return {"rollbacks": self.rollbacks, "lr_scale": self.lr_scale, "kl_scale": self.kl_scale}

    def load_state_dict(self, state: dict) -> None:
        self.rollbacks, self.lr_scale, self.kl_scale = state["rollbacks"], state["lr_scale"], state["kl_scale"]
