"""The trackers: the one table of ``trainer.logger``'s names.

An entry names its backend class (built by ``rlhf_hpc.observability.tracking.Tracker``) and the
optional package it needs (checked at dry run by ``rlhf_hpc.recipe.packages``), so the layers
below the tracker know a logger without importing it. A new tracker: a backend class with
``log(metrics, step, log_step)`` and ``close()`` (optionally ``log_generations(rows, step,
log_step)``: validation generations) in observability/tracking.py and one
``register_tracker`` line here (docs/extending.md). ``metrics.jsonl`` in the run directory is
always written and is no entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rlhf_hpc.config.registry import Registry

__all__ = ["TRACKERS", "TrackerSpec", "register_tracker"]


@dataclass(frozen=True)
class TrackerSpec:
    """``entry``: ``"module:Class"``; ``package``: its feature in ``recipe.packages.PACKAGES`` (None:
    none needed)."""

    name: str
    entry: str
    package: Optional[str]


TRACKERS: Registry[TrackerSpec] = Registry("logger", "trainer.logger")


def register_tracker(spec: TrackerSpec) -> TrackerSpec:
    return TRACKERS.register(spec.name, spec)


_BACKENDS = "rlhf_hpc.observability.tracking"
register_tracker(TrackerSpec("console", f"{_BACKENDS}:ConsoleBackend", None))
register_tracker(TrackerSpec("tensorboard", f"{_BACKENDS}:TensorBoardBackend", "tensorboard"))
register_tracker(TrackerSpec("wandb", f"{_BACKENDS}:WandbBackend", "wandb"))
register_tracker(TrackerSpec("mlflow", f"{_BACKENDS}:MLflowBackend", "mlflow"))
