"""A Slurm node's job before it starts torchrun: its imports and its reading of the run's config,
with and without the cross-field checks (BENCHMARKS.md, "A node's job start"):

    python -m benchmarks.node_job_start [--rounds 3]

Writes a one-step ``recipe=tiny_klppo`` run's resolved config, then times, alternating, new
interpreters that do what ``launch.slurm.TrainingJob`` does first: import ``rlhf_hpc.launch.slurm``
(unpickling the job imports it) and ``load_resolved`` the config, checked (before) or not (now: the
ranks check it). Prints each one's user + system CPU seconds and whether it imported transformers.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

__all__: list[str] = []  # a script: nothing here is imported elsewhere

READ = (
    "import sys, rlhf_hpc.launch.slurm\n"
    "from rlhf_hpc.recipe.load import load_resolved\n"
    "load_resolved(sys.argv[1], checks=sys.argv[2] == 'checked')\n"
    "print('transformers' in sys.modules)\n"
)


def node_read(config: Path, how: str) -> tuple[float, bool]:
    """(CPU seconds, transformers imported) of one new interpreter reading ``config``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-c", READ, str(config), how], capture_output=True, text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return cpu, out.stdout.strip() == "True"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    from rlhf_hpc.recipe.load import load_config, write_resolved

    with tempfile.TemporaryDirectory() as run_dir:
        cfg, _ = load_config("tiny_klppo", [f"trainer.default_local_dir={run_dir}"])
        config = write_resolved(cfg, run_dir)
        print("| round | checked: CPU-s (transformers imported) | not checked: CPU-s (transformers imported) |")
        print("| --- | --- | --- |")
        for r in range(1, args.rounds + 1):
            cells = [
                f"{cpu:.2f} ({'yes' if tf else 'no'})" for cpu, tf in (node_read(config, h) for h in ("checked", "not"))
            ]
            print(f"| {r} | {cells[0]} | {cells[1]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
