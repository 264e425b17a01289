"""A one-step tiny launch's CPU seconds, two checkouts side by side (BENCHMARKS.md, "A CPU rank's vLLM
start"):

    python -m benchmarks.launch_cpu --checkouts OLD_DIR NEW_DIR [--rounds 2] [--engines vllm hf]

Runs ``launch.py recipe=tiny_klppo trainer.total_training_steps=1`` from each checkout in turn
(alternating, round after round, each engine), with this interpreter: a checkout's own ``rlhf_hpc``
comes first on the path, from its directory. Prints user + system CPU seconds of the launch and all it
started, and wall seconds. Inductor's cache (``/tmp/torchinductor_$USER``) is left as it is: remove it
first to measure a machine's first start in round 1.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__: list[str] = []  # a script: nothing here is imported elsewhere


def launch(checkout: Path, engine: str, run_dir: Path) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one launch from ``checkout``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            "launch.py",
            "recipe=tiny_klppo",
            "trainer.total_training_steps=1",
            f"trainer.default_local_dir={run_dir}",
            f"actor_rollout_ref.rollout.name={engine}",
        ],
        cwd=checkout,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise SystemExit(f"{checkout}: the {engine} launch failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.launch_cpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkouts", nargs=2, required=True, type=Path, metavar=("OLD", "NEW"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--engines", nargs="+", default=["vllm", "hf"])
    args = ap.parse_args(argv)
    print("| round | engine | checkout | CPU-s | wall s |\n| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="launch-cpu-") as tmp:
        for r in range(1, args.rounds + 1):
            for engine in args.engines:
                for name, checkout in zip(("old", "new"), args.checkouts):
                    cpu, wall = launch(checkout.resolve(), engine, Path(tmp) / f"{r}-{engine}-{name}")
                    print(f"| {r} | {engine} | {name} | {cpu:.1f} | {wall:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
