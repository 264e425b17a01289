"""Fault injection for tests (``trainer.inject_fault``): the one seam through which tests make
a run fail on purpose. The trainer calls these hooks at fixed points of its loop; with no fault
configured each hook does nothing. Nothing here replaces module attributes.

``KIND@STEP[:RANK]`` with KIND:
- ``nan_grad``: a NaN advantage before the actor update (-> NaN loss and gradient);
- ``lr_x1000``: the actor's learning rate x1000 for that update (a divergent step);
- ``kill``: this rank dies after generation, first attempt only (a crashed worker);
- ``kill_in_save``: this rank dies after the first checkpoint component was written, first
  attempt only (a crash in the middle of a checkpoint write);
- ``wrong_weights``: the weight sync before that step's generation (step 0: the preflight's)
  sends every tensor x1.5 (a broken sync: the engine samples from other weights than the
  actor's, which the log-prob check must catch);
- ``raise``: this rank raises a RuntimeError after generation, first attempt only (a bug in one
  rank: the others wait in their next collective);
- ``hang``: this rank stops itself (SIGSTOP) after generation, first attempt only: a hung rank,
  which only the launcher's heartbeat watchdog finds before ``trainer.dist_timeout_s``;
- ``slow``: from that step on, every step of this rank (all ranks by default) takes
  ``SLOW_STEP_S`` longer (a slow node): a run whose length does not depend on how fast the
  machine is, for the tests of time limits.
Each fault but ``slow`` fires once: after a rollback or restart the same step runs clean.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Callable, Optional

__all__ = ["DEFAULT_RANK", "FaultInjector", "KINDS", "SLOW_STEP_S", "first_attempt", "parse_fault"]

KINDS = ("nan_grad", "lr_x1000", "kill", "kill_in_save", "wrong_weights", "raise", "hang", "slow")
DEFAULT_RANK = {
    "nan_grad": None,
    "lr_x1000": None,
    "kill": 1,
    "kill_in_save": 0,
    "wrong_weights": None,
    "raise": 1,
    "hang": 1,
    "slow": None,
}
SLOW_STEP_S = 1.0


def parse_fault(spec: Optional[str]) -> dict:
    """``"KIND@STEP[:RANK]"`` -> ``{KIND: STEP, "rank": RANK}``; ``{}`` for no fault."""
    if not spec:
        return {}
    kind, _, rest = spec.partition("@")
    step, _, rank = rest.partition(":")
    if kind not in KINDS or not step.isdigit() or (rank and not rank.isdigit()):
        raise ValueError(f"trainer.inject_fault: '{spec}' is not KIND@STEP[:RANK] with KIND in {', '.join(KINDS)}")
    out = {kind: int(step)}
    if rank:
        out["rank"] = int(rank)
    return out


def first_attempt() -> bool:
    """Before any restart of the workers (faults fire once, so the restart can recover)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and os.environ.get("RLHF_HPC_ATTEMPT", "0") == "0"


class FaultInjector:
    def __init__(self, spec: Optional[str], rank: int):
        self.fault = parse_fault(spec)
        self.rank = rank

    def _mine(self, kind: str, step: int) -> bool:
        if self.fault.get(kind) != step:
            return False
        return self.rank == self.fault.get("rank", DEFAULT_RANK[kind]) or DEFAULT_RANK[kind] is None

    def after_generation(self, step: int) -> None:
        if self._mine("kill", step) and first_attempt():
            os._exit(17)  # a worker dies in the middle of a step
        if self._mine("raise", step) and first_attempt():
            raise RuntimeError(f"fault injected: trainer.inject_fault=raise@{step} (rank {self.rank})")
        if self._mine("hang", step) and first_attempt():
            os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops, the heartbeat's too
        slow_from = self.fault.get("slow")
        if slow_from is not None and step >= slow_from and self.rank == self.fault.get("rank", self.rank):
            time.sleep(SLOW_STEP_S)

    @contextlib.contextmanager
    def around_actor_update(self, step: int, optimizer, batch: dict):
        if self.fault.get("nan_grad") == step:
            del self.fault["nan_grad"]
            batch["advantages"][0, 0] = float("nan")
        if self.fault.get("lr_x1000") == step:
            del self.fault["lr_x1000"]
            for g in optimizer.param_groups:
                g["lr"] *= 1000.0
        yield  # the update's scheduler step sets the learning rate afresh from its schedule

    def weights_transform(self, step: int) -> Optional[Callable]:
        """For ``sync_weights_to_rollout(transform=...)`` (``wrong_weights``)."""
        if self.fault.get("wrong_weights") != step:
            return None
        del self.fault["wrong_weights"]
        return lambda stream: ((name, t * 1.5) for name, t in stream)

    def checkpoint_hook(self, step: int) -> Optional[Callable[[str], None]]:
        """Called by ``save_checkpoint`` after each component it wrote (``kill_in_save``)."""
        if not (self.fault.get("kill_in_save") == step and first_attempt()):
            return None
        dies = self.rank == self.fault.get("rank", DEFAULT_RANK["kill_in_save"])

        def after_component(name: str) -> None:
            if dies:
                os._exit(17)

        return after_component
