"""The split layout against the colocated one, side by side, on the CPU async recipe.

    python -m benchmarks.split_layout [--steps 60] [--out DIR]

Three runs of ``recipe=tiny_grpo_async`` (the demo's copy task by GRPO, the same seed): colocated on
2 ranks; split, 2 trainer ranks + 1 rollout rank, one-step-off (staleness_threshold 1); and split
with a synchronous hand-off (staleness_threshold 0). One after the other on this machine. Reported
per run: its wall time, the mean step, the rollout ranks' generation and how much of it ran while
the trainer updated, the trainer's idle share, the staleness, and the score's rise (the last tenth
of the steps against the first). On 2 CPU cores three processes share two cores, so the overlap
cannot show as a faster step; the GPU figure is the time plan's (docs/async.md).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlhf_hpc.observability.tracking import read_metrics

__all__: list[str] = []  # a script: nothing here is imported elsewhere

RUNS = {
    "colocated, 2 ranks": [
        "actor_rollout_ref.hybrid_engine=true",
        "rollout.n_gpus_per_node=0",
        "async_training.staleness_threshold=0",
    ],
    "split 2 + 1, one-step-off": [],
    "split 2 + 1, staleness 0": ["async_training.staleness_threshold=0"],
}


def mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.fmean(values) if values else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.split_layout", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", help="where the runs go (default: a temporary directory)")
    args = ap.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="split-layout-"))
    repo = Path(__file__).resolve().parent.parent
    print("| run | wall s | step s | gen s | gen overlapped s | trainer idle | staleness max | score rise |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, overrides in RUNS.items():
        run = root / name.replace(" ", "_").replace(",", "").replace("+", "p")
        t0 = time.perf_counter()
        out = subprocess.run(
            [
                sys.executable,
                str(repo / "launch.py"),
                "recipe=tiny_grpo_async",
                f"trainer.total_training_steps={args.steps}",
                "trainer.save_freq=-1",
                f"trainer.default_local_dir={run}",
                *overrides,
            ],
            capture_output=True,
            text=True,
            cwd=repo,
        )
        wall = time.perf_counter() - t0
        if out.returncode != 0:
            print(out.stdout[-2000:], out.stderr[-2000:], file=sys.stderr)
            return out.returncode
        rows = read_metrics(run)[1:]  # (the first step warms up)
        tenth = max(1, len(rows) // 10)
        rise = mean(rows[-tenth:], "critic/score/mean") - mean(rows[:tenth], "critic/score/mean")
        print(
            f"| {name} | {wall:.0f} | {mean(rows, 'timing_s/step'):.3f} | {mean(rows, 'timing_s/gen'):.3f} | "
            f"{mean(rows, 'timing_s/gen_overlapped'):.3f} | {mean(rows, 'async/trainer_idle_share'):.2f} | "
            f"{max((r.get('rollout/staleness/max', 0.0) for r in rows), default=0.0):.0f} | {rise:+.3f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
