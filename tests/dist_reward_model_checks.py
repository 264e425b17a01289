"""The reward model built by the trainer's own path (build_reward_model) on 2 ranks (gloo, CPU),
FSDP2-sharded, each rank scoring its own rows; test_reward_model.py compares with a plain forward.

    torchrun --nproc-per-node=2 tests/dist_reward_model_checks.py RM_DIR OUT

Each rank writes OUT/rank<R>.json: its rows and, per case, its scores.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rlhf_hpc.distributed.process_group import exit_process, init_distributed
from rlhf_hpc.ops.batching import select_rows
from rlhf_hpc.recipe.load import load_config
from rlhf_hpc.rewards.reward_model import build_reward_model
from tests.test_reward_model import random_batch

FP32 = "mixed_precision.param_dtype=float32"
CASES = {
    "packed": ["fsdp_config.fsdp_size=-1", "use_remove_padding=true"],
    "padded": ["fsdp_config.fsdp_size=-1", "use_remove_padding=false"],
    "token_budget": ["fsdp_config.fsdp_size=-1"],
    "param_offload": ["fsdp_config.fsdp_size=-1", "fsdp_config.param_offload=true"],
    "hsdp_2x1": ["fsdp_config.fsdp_size=1"],  # a 2-D (replicate 2, shard 1) mesh
}


def main(rm_dir: str, out: Path) -> None:
    base = [
        "reward_model.enable=true",
        f"reward_model.model.path={rm_dir}",
        "reward_model.micro_batch_size_per_gpu=2",
        f"reward_model.model.fsdp_config.{FP32}",
    ]
    batch, _ = random_batch(n=8)
    ctx = None
    result: dict = {"scores": {}}
    for name, keys in CASES.items():
        extra = [f"reward_model.model.{k}" for k in keys]
        if name == "token_budget":  # token groups differ by rank: the micro-batch count is agreed on
            extra += ["reward_model.use_dynamic_bsz=true", "reward_model.forward_max_token_len_per_gpu=40"]
        cfg, _ = load_config("tiny_klppo", base + extra)
        ctx = ctx or init_distributed(cfg)
        rows = list(range(ctx.rank * 4, ctx.rank * 4 + 4))
        rm = build_reward_model(cfg, ctx, input_tokenizer=None)
        weight = next(rm.model.parameters())
        result.setdefault("mesh_dims", {})[name] = weight.device_mesh.ndim if isinstance(weight, DTensor) else 0
        result["scores"][name] = rm.score(select_rows(batch, rows)).tolist()
        result.update(rank=ctx.rank, world=ctx.world_size, rows=rows)
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
