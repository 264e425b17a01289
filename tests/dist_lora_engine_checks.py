"""The vLLM engine's LoRA path under torchrun (1 rank, gloo, vLLM's CPU build): how often vLLM reads
the adapter from disk. test_lora.py runs and reads it.

    torchrun --nproc-per-node=1 tests/dist_lora_engine_checks.py OUT

Counts vLLM's adapter loads (its worker LoRA manager's ``_load_adapter``, wrapped here: the test's
seam, never the product's) over two syncs of a LoRA actor, each followed by two generations of
many decode steps, and checks the engine samples with the adapter it was given last (greedy tokens
equal to a plain transformers decode of the merged model). Writes OUT/lora_engine.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf_hpc.config.schema import ModelConfig
from rlhf_hpc.models.hf import build_causal_lm
from rlhf_hpc.models.lora import apply_lora, lora_scaling, merged_weights
from rlhf_hpc.recipe.load import load_config
from rlhf_hpc.rollout.base import Sampling
from rlhf_hpc.rollout.factory import make_engine
from rlhf_hpc.rollout.weight_sync import stream_full_params, sync_weights_to_rollout
from tests.dist_rollout_checks import hf_greedy

CPU = torch.device("cpu")
P, R = 8, 24


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    cfg, _ = load_config(
        "tiny_klppo",
        [
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.model.lora_rank=8",
            "actor_rollout_ref.model.lora_alpha=16",
            f"data.max_prompt_length={P}",
            f"data.max_response_length={R}",
        ],
    )
    engine = make_engine(cfg, "tiny://qwen2", CPU)
    from vllm.lora.worker_manager import WorkerLoRAManager

    loads = []
    original = WorkerLoRAManager._load_adapter

    def counted(self, request):
        loads.append(request.lora_int_id)
        return original(self, request)

    WorkerLoRAManager._load_adapter = counted
    model = apply_lora(
        build_causal_lm("tiny://qwen2", torch.float32, seed=0),
        ModelConfig(path="tiny://qwen2", lora_rank=8, lora_alpha=16),
        seed=5,
    )
    prompts = [[5, 9, 13, 2], [7, 7, 30, 41, 3]]
    greedy = Sampling(n=1, temperature=0.0, max_tokens=R, do_sample=False, ignore_eos=True)
    res: dict = {"loads_per_sync": [], "greedy_matches": []}
    for sync in range(2):
        with torch.no_grad():  # a visible change of the adapter between syncs
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(sync + 1)))
        before = len(loads)
        sync_weights_to_rollout(model, engine, torch.float32, 1.0)
        outs = [engine.generate(prompts, greedy) for _ in range(2)]
        res["loads_per_sync"].append(len(loads) - before)
        merged = dict(merged_weights(stream_full_params(model, torch.float32, 1.0), lora_scaling(model)))
        expected = hf_greedy(merged, prompts, R)
        res["greedy_matches"].append(
            [[r.token_ids for r in group][0] == e for out_ in outs for group, e in zip(out_, expected)]
        )
    res["decode_steps_per_generate"] = R
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora_engine.json").write_text(json.dumps(res))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
