"""The tool demo's teaching on one and two torch threads, OpenMP's threads spinning (the default) or
waiting passively, alone and beside a busy core (BENCHMARKS.md, "The test workers' own threads"):

    python -m benchmarks.teaching_threads [--steps 30]

Each case is a new interpreter (``OMP_WAIT_POLICY`` is read once, as libgomp loads with torch)
teaching ``--steps`` calling steps of ``rlhf_hpc.data.tool_warm_start.DEMO_TEACHING``'s rows.
Prints wall and CPU seconds; "busy" runs a Python loop on the side.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

__all__: list[str] = []  # a script: nothing here is imported elsewhere

TEACH = (
    "import sys, tempfile, time, torch\n"
    "torch.set_num_threads(int(sys.argv[1]))\n"
    "from rlhf_hpc.data.tool_warm_start import DEMO_TEACHING, teach\n"
    "steps = int(sys.argv[2])\n"
    "args = dict(DEMO_TEACHING, steps=steps, calling_steps=steps)\n"
    "t, c = time.time(), time.process_time()\n"
    "with tempfile.TemporaryDirectory() as out:\n"
    "    teach(out, **args)\n"
    "print(f'{time.time() - t:.1f} {time.process_time() - c:.1f}')\n"
)


def case(threads: int, policy: str, steps: int) -> tuple[str, str]:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run(
        [sys.executable, "-c", TEACH, str(threads), str(steps)], env=env, capture_output=True, text=True, check=True
    )
    wall, cpu = out.stdout.split()[-2:]
    return wall, cpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    print("| other core | threads | OpenMP waits | wall s | CPU-s |")
    print("| --- | --- | --- | --- | --- |")
    for side in ("free", "busy"):
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if side == "busy" else None
        try:
            for threads in (1, 2):
                for policy in ("default", "PASSIVE"):
                    wall, cpu = case(threads, policy, args.steps)
                    print(f"| {side} | {threads} | {policy.lower()} | {wall} | {cpu} |", flush=True)
        finally:
            if busy is not None:
                busy.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
