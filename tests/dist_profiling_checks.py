"""The communication meter on an HSDP mesh under torchrun (gloo, CPU); test_profiling.py runs it.

    torchrun --nproc-per-node=4 tests/dist_profiling_checks.py OUT

A tiny Qwen2 on a (replicate 2, shard 2) mesh runs forward/backward twice, step 2 traced by
``StepProfiler`` into OUT/step2/ (the trace and the meter's ``rank<R>.comm.json``). That the hook
leaves the gradients as they are is shown by test_engine_dist.py's HSDP equivalence runs, which
go through the same ``parallelize``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf_hpc.config.schema import FSDPConfig, MixedPrecisionConfig
from rlhf_hpc.distributed.fsdp import parallelize
from rlhf_hpc.distributed.process_group import build_train_mesh, exit_process
from rlhf_hpc.models.hf import build_causal_lm
from rlhf_hpc.observability.perf import Timer
from rlhf_hpc.observability.profiling import StepProfiler
from rlhf_hpc.recipe.load import load_config

CPU = torch.device("cpu")


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    fsdp = FSDPConfig(fsdp_size=2, mixed_precision=MixedPrecisionConfig(param_dtype="float32", reduce_dtype="float32"))
    model = build_causal_lm("tiny://qwen2?vocab_size=64", torch.float32)
    parallelize(model, build_train_mesh(CPU, 4, 2), fsdp, CPU)
    cfg = load_config(
        "tiny_klppo",
        ["trainer.n_gpus_per_node=4", "global_profiler.steps=[2]", f"global_profiler.save_path={out}"],
        check_files=False,
    )[0]
    profiler = StepProfiler(cfg, rank, CPU, out)
    torch.manual_seed(rank)
    ids = torch.randint(0, 64, (2, 12))
    for step in (1, 2):
        model.zero_grad()
        timer = Timer()
        with profiler.step(step, timer), timer("step"):
            with timer("old_log_prob"):
                loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
            with timer("update_actor"):
                loss.backward()
    dist.destroy_process_group()
    exit_process(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
