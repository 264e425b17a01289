"""The time plan against measured steps on this CPU: three workloads through the real trainer, each
step's ``plan/<phase>_s`` (planned with that step's lengths, on this machine's calibration) beside
its ``timing_s/<phase>``; the median over steps after the first two, and the error per phase.

    python launch.py calibrate          # first: this machine's figures
    python -m benchmarks.time_plan_check [--only demo,bench,smollm2] [--steps 8]

  demo      recipe tiny_klppo as it is (0.3M parameters, overhead-bound)
  bench     the 19.5M-parameter workload of benchmarks.ppo_step (64 prompts x 32 new tokens)
  smollm2   recipe smollm2_add_klppo (SmolLM2-135M-Instruct, bf16; needs the model in
            ~/.cache/rlhf-hpc/models, ../shared/notes/real-models.md), fewer steps
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.ppo_step import REPO, WORKLOAD

__all__: list[str] = []  # a script: nothing here is imported elsewhere

NO_SAVES = ["trainer.save_freq=0", "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.logger=[console]"]
WORKLOADS = {
    "demo": ("tiny demo (0.3M, fp32)", ["recipe=tiny_klppo", *NO_SAVES], 1.0),
    "bench": ("bench workload (19.5M, fp32)", ["recipe=tiny_klppo", *WORKLOAD, *NO_SAVES], 1.0),
    "smollm2": ("SmolLM2-135M (bf16)", ["recipe=smollm2_add_klppo", *NO_SAVES], 0.5),
}
PHASES = ["update_weights", "gen", "old_log_prob", "ref", "values", "update_critic", "update_actor", "step"]


def run(args: list[str], steps: int, run_dir: Path) -> list[dict]:
    cmd = [
        sys.executable,
        "launch.py",
        *args,
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={run_dir}",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"the run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def compare(rows: list[dict], skip: int = 2) -> dict[str, tuple[float, float]]:
    """phase -> (median measured s, median planned s) over the steps after ``skip``."""
    rows = rows[skip:] or rows[-1:]
    out = {}
    for phase in PHASES:
        if f"timing_s/{phase}" in rows[0] and f"plan/{phase}_s" in rows[0]:
            out[phase] = (
                statistics.median(r[f"timing_s/{phase}"] for r in rows),
                statistics.median(r[f"plan/{phase}_s"] for r in rows),
            )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(WORKLOADS))
    ap.add_argument("--steps", type=int, default=8, help="steps of each run (SmolLM2: half, at least 4)")
    args = ap.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            label, launch_args, share = WORKLOADS[name]
            steps = max(4, int(args.steps * share))
            results[label] = compare(run(launch_args, steps, Path(tmp) / name))
            print(f"{label}: done ({steps} steps)", file=sys.stderr, flush=True)
    print("measured / planned seconds per phase (median over steps 3..N), error = planned / measured - 1")
    print("| phase | " + " | ".join(results) + " |")
    print("| --- |" + " --- |" * len(results))
    for phase in PHASES:
        cells = []
        for figures in results.values():
            if phase in figures:
                m, p = figures[phase]
                cells.append(f"{m:.3g} / {p:.3g} ({p / m - 1:+.0%})")
            else:
                cells.append("-")
        print(f"| {phase} | " + " | ".join(cells) + " |")
    print(json.dumps({k: {p: list(v) for p, v in f.items()} for k, f in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
