"""Tensor-parallel rollout (TP=2) under torchrun on CPU: 2 ranks, one vLLM tensor-parallel group, the
FSDP actor sharded over both. test_rollout_tp.py runs and reads this.

    torchrun --nproc-per-node=2 tests/dist_rollout_tp_checks.py OUT [MODEL]   # default tiny://qwen2

Each rank writes OUT/rank<r>.json. Rank 0 closes its engine, rank 1 ends through ``exit_process``
without closing it (the path where vLLM's shared-memory segments used to be left behind).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf_hpc.distributed.process_group import build_rollout_tp_group, exit_process
from rlhf_hpc.ppo.checkpoint import full_model_state
from rlhf_hpc.ppo.step_batch import step_seed
from rlhf_hpc.recipe.load import load_config
from rlhf_hpc.rollout.base import Sampling
from rlhf_hpc.rollout.factory import make_engine
from rlhf_hpc.rollout.weight_sync import sync_weights_to_rollout
from tests.dist_rollout_checks import engine_vs_actor, hf_greedy, sharded_fp32_actor

CPU = torch.device("cpu")
P, R = 8, 8


def main(out: Path, path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, _ = load_config(
        "tiny_klppo",
        [
            "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.model.path={path}",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            f"data.max_prompt_length={P}",
            f"data.max_response_length={R}",
        ],
    )
    temperature = 0.8
    actor = sharded_fp32_actor(cfg, world, temperature, path)
    engine = make_engine(cfg, path, CPU, build_rollout_tp_group(2, 2))
    # vLLM's CPU build has its shared-memory communicator only in the AVX-512 kernels (_C); on an
    # AVX2-only CPU (_C_AVX2) tensor parallelism all-reduces through torch.distributed, no segments
    res: dict = {
        "rank": rank,
        "dp_rank": engine.dp_rank,
        "shm_segments": list(engine._shm_segments),
        "shm_manager": hasattr(torch.ops._C, "init_shm_manager"),
    }

    state = full_model_state(actor.model)
    states = [None] * world
    dist.all_gather_object(states, state if rank == 0 else None)
    sync_weights_to_rollout(actor.model, engine, torch.float32, bucket_mb=0.05)

    g = torch.Generator().manual_seed(rank)  # each rank has its own prompts
    prompts = [
        torch.randint(1, 256, (int(n),), generator=g).tolist() for n in torch.randint(2, P + 1, (4,), generator=g)
    ]
    greedy = engine.generate(prompts, Sampling(n=1, temperature=0.0, max_tokens=R, do_sample=False))
    res["greedy_equal_transformers"] = [
        o[0].token_ids == h for o, h in zip(greedy, hf_greedy(states[0], prompts, R, path))
    ]
    res["greedy"] = [o[0].token_ids for o in greedy]

    # seeded per step as the trainer does (from the engine's data-parallel rank), and unseeded: then
    # the draws come from the group's generation RNG, while the training RNG differs between the ranks
    seeded = Sampling(n=2, temperature=temperature, max_tokens=R, seed=step_seed(1, 1, engine.dp_rank))
    unseeded = Sampling(n=2, temperature=temperature, max_tokens=R)
    torch.manual_seed(100 + rank)
    expected = torch.rand(4)
    torch.manual_seed(100 + rank)
    outs = {"seeded": engine.generate(prompts, seeded), "unseeded": engine.generate(prompts, unseeded)}
    res["training_rng_untouched"] = torch.equal(torch.rand(4), expected)
    for tag, groups in outs.items():
        flat = [r for group in groups for r in group]
        res[tag] = {
            "mismatch": engine_vs_actor(actor, [p for p in prompts for _ in range(2)], flat),
            "n_per_prompt": [len(group) for group in groups],
            "tokens": [r.token_ids for r in flat],
        }

    # the bug itself, bypassing the engine's guard: both ranks submit the same requests but seed them
    # by global rank (EOS ignored, so the batch shapes stay equal and the group returns garbage
    # instead of hanging). What the standing check sees then:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    group_prompts = [None, None]
    dist.all_gather_object(group_prompts, prompts)
    shared = group_prompts[0]
    with engine.rng.active():
        outs = engine.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in shared],
            SamplingParams(
                n=2,
                temperature=temperature,
                max_tokens=R,
                logprobs=0,
                ignore_eos=True,
                detokenize=False,
                seed=1000 + rank,
            ),
            use_tqdm=False,
        )
    from rlhf_hpc.rollout.base import Response

    flat = [
        Response(list(c.token_ids), [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)], "length")
        for o in outs
        for c in o.outputs
    ]
    res["apart"] = engine_vs_actor(actor, [p for p in shared for _ in range(2)], flat)

    # a caller that seeds by global rank is refused on both ranks (no hang, no silent garbage)
    try:
        engine.generate(prompts, Sampling(n=1, temperature=temperature, max_tokens=R, seed=step_seed(1, 1, rank)))
        res["per_rank_seed_error"] = None
    except RuntimeError as e:
        res["per_rank_seed_error"] = str(e)

    # the all_gather_into_tensor path (NCCL's) gives the same tensors as the row-piece path (gloo's)
    from rlhf_hpc.rollout.weight_sync import stream_full_params

    pieces = dict(stream_full_params(actor.model, torch.float32, bucket_mb=0.01, into_tensor=False))
    whole = dict(stream_full_params(actor.model, torch.float32, bucket_mb=0.01, into_tensor=True))
    res["into_tensor_equal"] = pieces.keys() == whole.keys() and all(torch.equal(pieces[k], whole[k]) for k in pieces)
    dist.barrier()
    # rank 0 closes its engine; rank 1 ends through the fast exit alone (exit_process, no close)
    if rank == 0:
        engine.close()
        res["segments_left_after_close"] = [p for p in res["shm_segments"] if Path(p).exists()]
    (out / f"rank{rank}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "tiny://qwen2")
    exit_process(0)
