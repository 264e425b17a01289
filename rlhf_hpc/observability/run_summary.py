"""The line a finished run ends on: what it did, where its results are, and the commands that come next."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

__all__ = ["run_summary"]

SCORE = "critic/score/mean"


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def run_summary(
    steps: int,
    total_steps: int,
    last: dict[str, float],
    validation: dict[str, float],
    wall_s: float,
    run_dir: Path,
    checkpoint: Optional[Path],
) -> str:
    """One line: steps done, the last step's score, the last validation's figures (``val-core/``),
    the wall time, where the checkpoint and metrics are, and what to run next (compare, export,
    resume). ``checkpoint``: the last one saved (None: nothing saved, so neither export nor resume)."""
    parts = [f"done: {steps}/{total_steps} steps in {_duration(wall_s)}"]
    if SCORE in last:
        parts.append(f"last score {last[SCORE]:.3g} ({SCORE})")
    val = {k: v for k, v in validation.items() if k.startswith("val-core/")}
    if val:
        parts.append("validation " + ", ".join(f"{k} {v:.3g}" for k, v in sorted(val.items())))
    where = [f"metrics {run_dir / 'metrics.jsonl'}"]
    if checkpoint is not None:
        where.insert(0, f"checkpoint {checkpoint}")
    parts.append(", ".join(where))
    nxt = [f"python launch.py compare {run_dir} OTHER_RUN_DIR --out DIR"]
    if checkpoint is not None:
        nxt.append(f"python launch.py export {checkpoint} --out DIR")
        nxt.append("the same command with a larger trainer.total_training_steps resumes from it")
    else:
        nxt.append("no checkpoint to export or resume from (trainer.save_freq)")
    return "[rlhf-hpc] " + "; ".join(parts) + "; next: " + " | ".join(nxt)
