"""Host memory of one node while the training models are built from a pretrained checkpoint.

    python -m benchmarks.startup_memory --model DIR [--ranks 1 2 4] [--before TREE] [--json OUT]

For each rank count, ``torchrun --nproc-per-node=N`` runs ``build_training_models`` (actor, reference and
critic of the recipe, from ``--model``, fp32 master weights) and exits; nothing else (no rollout
engine, no step). Measured: the peak over time of the node's total proportional set size (PSS: a
page shared by k processes counts 1/k to each, so shared libraries and the page cache's file
mappings are not counted N times), sampled every 20 ms over torchrun and its workers, and each
rank's own peak RSS (VmHWM). ``--before TREE``: the same run with another checkout of the project
on ``PYTHONPATH`` (e.g. ``git worktree add ../before bd611fa``), measured in the same invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__: list[str] = []  # a script: nothing here is imported elsewhere

# what each rank runs: only APIs that both the current and the earlier tree have
WORKER = r"""
import json, os, sys, torch
try:  # the layered package
    from rlhf_hpc.recipe.load import load_config
    from rlhf_hpc.distributed.process_group import init_distributed
    from rlhf_hpc.ppo.training_models import build_training_models
except ImportError:  # a tree from before the layers
    from rlhf_hpc.recipe import load_config
    from rlhf_hpc.dist import init_distributed
    from rlhf_hpc.engine import build_engine as build_training_models
cfg, _ = load_config("tiny_klppo", json.loads(sys.argv[1]), check_files=False)
ctx = init_distributed(cfg)
models = build_training_models(cfg, ctx, total_steps=10)
torch.distributed.barrier()
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
out = [None] * ctx.world_size
torch.distributed.all_gather_object(out, peak)
if ctx.rank == 0:
    print("RESULT " + json.dumps({"rank_peak_rss": out}), flush=True)
torch.distributed.barrier()
sys.stdout.flush()
os._exit(0)  # (as the trainer's workers end: no teardown of gloo's and shared memory's threads)
"""


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _tree(root: int) -> list[int]:
    """``root`` and its descendants (from /proc/<pid>/task/<pid>/children)."""
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        try:
            todo += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        except OSError:
            pass
    return pids


def run(model: str, ranks: int, tree: Path) -> dict:
    overrides = [
        f"actor_rollout_ref.model.path={model}",
        f"trainer.n_gpus_per_node={ranks}",
        "data.train_files=synthetic://copy",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.rollout.name=hf",
    ]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={ranks}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        "--no-python",
        sys.executable,
        "-c",
        WORKER,
        json.dumps(overrides),
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tree)
    peak = [0]

    def sample():
        while proc.poll() is None:
            peak[0] = max(peak[0], sum(_pss(p) for p in _tree(proc.pid)))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate(timeout=1800)
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}, {ranks} ranks: exit {proc.returncode}\n{err[-3000:]}")
    result = json.loads(next(line[7:] for line in out.splitlines() if line.startswith("RESULT ")))
    return {"ranks": ranks, "node_peak_pss": peak[0], "seconds": time.perf_counter() - t0, **result}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.startup_memory", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", required=True, help="a Hugging Face model directory (e.g. python -m rlhf_hpc.models.real_model)"
    )
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--before", type=Path, help="an earlier checkout, measured the same way")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    trees = {"now": Path(__file__).resolve().parents[2]}
    if args.before:
        trees = {"before": args.before.resolve(), **trees}
    rows = []
    for n in args.ranks:
        for label, tree in trees.items():
            r = run(args.model, n, tree)
            r["code"] = label
            rows.append(r)
            gb = 2**30
            print(
                f"{label:>6} {n} ranks: node peak PSS {r['node_peak_pss'] / gb:.2f} GiB, per-rank peak RSS "
                f"{', '.join(f'{b / gb:.2f}' for b in r['rank_peak_rss'])} GiB ({r['seconds']:.0f} s)",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
