"""Where one training step's time goes, per phase, from a torch.profiler trace of rank 0.

    python -m benchmarks.step_profile [--step 3] [--rank R] [--repo CHECKOUT] [key=value ...]

Runs the ``ppo_step`` workload with ``trainer.profile_steps=[STEP]`` (the trainer's own profiler
seam) and splits each phase's wall time (the trainer's ``phase/*`` ranges) into kinds of work:
matrix products, attention, log-softmax/entropy over the vocabulary, the optimizer, collectives
(FSDP's and the trainer's, incl. waiting for the other rank), data movement (copies, gathers,
concatenation) and the rest (Python, hooks, small ops). Each event is counted once, in the
outermost range that names a kind.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from benchmarks.ppo_step import REPO, run

__all__: list[str] = []  # a script: nothing here is imported elsewhere

KINDS = [  # (kind, name prefixes), first match wins
    (
        "collectives",
        (
            "c10d::",
            "gloo:",
            "record_param_comms",
            "FSDP::all_gather",
            "FSDP::post_backward_reduce",
            "FSDP::all_reduce",
            "FSDP::reduce_scatter",
            "ReplicaGradients.",
        ),
    ),
    ("optimizer", ("Optimizer.step", "aten::_fused_adamw", "aten::_foreach_")),
    ("attention", ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product", "ScaledDotProduct")),
    (
        "matmul",
        (
            "aten::linear",
            "aten::matmul",
            "aten::mm",
            "aten::addmm",
            "aten::bmm",
            "MmBackward",
            "AddmmBackward",
            "BmmBackward",
            "LinearBackward",
        ),
    ),
    (
        "vocabulary softmax",
        (
            "aten::log_softmax",
            "aten::_log_softmax",
            "aten::logsumexp",
            "LogSoftmaxBackward",
            "aten::softmax",
            "aten::_softmax",
        ),
    ),
    (
        "data movement",
        (
            "aten::copy_",
            "aten::cat",
            "aten::_chunk_cat",
            "aten::index",
            "aten::gather",
            "aten::scatter",
            "aten::masked_scatter",
            "aten::clone",
            "aten::contiguous",
            "aten::index_select",
            "aten::masked_select",
            "aten::_to_copy",
            "aten::repeat",
            "aten::stack",
            "aten::pad",
            "aten::constant_pad_nd",
        ),
    ),
]


def kind_of(name: str) -> str | None:
    for kind, prefixes in KINDS:
        if any(name.startswith(p) or p in name for p in prefixes):
            return kind
    return None


def breakdown(trace: Path) -> dict[str, dict[str, float]]:
    """{phase: {kind: seconds, "total": seconds}} from a chrome trace of one rank."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    phases = [e for e in events if e["name"].startswith("phase/")]
    work = sorted((e for e in events if kind_of(e["name"])), key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    outermost, open_until = [], {}
    for e in work:  # skip events nested in an already counted one on the same thread
        if e["ts"] < open_until.get(e["tid"], -1):
            continue
        outermost.append(e)
        open_until[e["tid"]] = e["ts"] + e["dur"]
    out: dict[str, dict[str, float]] = {}
    for p in phases:
        start, end = p["ts"], p["ts"] + p["dur"]
        kinds: dict[str, float] = defaultdict(float)
        for e in outermost:
            if start <= e["ts"] < end and e["tid"] == p["tid"]:
                kinds[kind_of(e["name"])] += min(e["dur"], end - e["ts"]) / 1e6
        name = p["name"].removeprefix("phase/")
        acc = out.setdefault(name, defaultdict(float))
        acc["total"] += p["dur"] / 1e6
        for k, v in kinds.items():
            acc[k] += v
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step", type=int, default=3)
    ap.add_argument("--trace", type=Path, help="analyse this trace instead of running")
    ap.add_argument("--rank", type=int, default=0, help="the rank whose trace is analysed")
    ap.add_argument(
        "--repo", type=Path, default=REPO, help="profile this checkout (e.g. a worktree of an older commit)"
    )
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.trace:
        table = breakdown(args.trace)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            run(args.step, [f"trainer.profile_steps=[{args.step}]", *args.overrides], run_dir, args.repo)
            table = breakdown(run_dir / "profile" / f"step{args.step}" / f"rank{args.rank}.pt.trace.json")
    kinds = [k for k, _ in KINDS]
    print(f"seconds on rank {args.rank}, step", args.step, " ".join(args.overrides))
    print("| phase | total | " + " | ".join(kinds) + " | other |")
    print("| --- |" + " --- |" * (len(kinds) + 2))
    for phase, acc in table.items():
        other = acc["total"] - sum(acc.get(k, 0.0) for k in kinds)
        print(
            f"| {phase} | {acc['total']:.2f} | "
            + " | ".join(f"{acc.get(k, 0.0):.2f}" for k in kinds)
            + f" | {other:.2f} |"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
