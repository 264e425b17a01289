"""Colocated rollout under torchrun (2 ranks, gloo): the FSDP actor is sharded over both ranks and
each rank has its own engine. test_rollout_dist.py runs and reads this.

    torchrun --nproc-per-node=2 tests/dist_rollout_checks.py {vllm|hf} OUT

Rank 0 writes OUT/<engine>.json; every rank's measurements are gathered into it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf_hpc.config.schema import FSDPConfig, MixedPrecisionConfig
from rlhf_hpc.distributed.process_group import all_reduce_max_int, all_reduce_sum, build_train_mesh, exit_process
from rlhf_hpc.models.hf import build_causal_lm
from rlhf_hpc.ops.batching import make_padded_batch
from rlhf_hpc.ppo.actor import Actor, ActorSpec, per_token_logprobs
from rlhf_hpc.ppo.checkpoint import full_model_state
from rlhf_hpc.ppo.optim import build_optimizer
from rlhf_hpc.ppo.update import Placement
from rlhf_hpc.recipe.load import load_config
from rlhf_hpc.rollout.base import Sampling, logprob_mismatch
from rlhf_hpc.rollout.factory import make_engine
from rlhf_hpc.rollout.weight_sync import stream_full_params, sync_weights_to_rollout

CPU = torch.device("cpu")
P, R = 8, 8


def hf_greedy(state: dict, prompts: list[list[int]], max_tokens: int, path: str = "tiny://qwen2") -> list[list[int]]:
    """Plain transformers greedy decoding of a model with exactly ``state`` as weights."""
    model = build_causal_lm(path, torch.float32, seed=99)
    model.load_state_dict(state)
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            seq = model.generate(
                torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            outs.append(seq[0, len(p) :].tolist())
    return outs


def engine_vs_actor(actor: Actor, prompts, responses) -> dict[str, float]:
    """Engine log-probs of the sampled tokens vs the actor's for the same tokens."""
    batch = make_padded_batch(prompts, [r.token_ids for r in responses], 0, P, R)
    lp, _ = per_token_logprobs(actor.model, batch, actor.temperature, remove_padding=True)
    engine_lp = torch.zeros_like(lp)
    for i, r in enumerate(responses):
        engine_lp[i, : len(r.logprobs)] = torch.tensor(r.logprobs)
    return logprob_mismatch(engine_lp, lp.detach(), batch["response_mask"])


def sharded_fp32_actor(cfg, world: int, temperature: float, path: str = "tiny://qwen2") -> Actor:
    """The tiny actor in fp32, sharded over every rank (FULL_SHARD), with the recipe's actor config."""
    from rlhf_hpc.distributed.fsdp import parallelize

    model = build_causal_lm(path, torch.float32, seed=0)
    fsdp = FSDPConfig(fsdp_size=-1, mixed_precision=MixedPrecisionConfig(param_dtype="float32"))
    parallelize(model, build_train_mesh(CPU, world, -1), fsdp, CPU)
    acfg = cfg.actor_rollout_ref.actor
    return Actor(
        model,
        acfg,
        ActorSpec(
            temperature=temperature,
            optimizer=build_optimizer(model, acfg.optim),
            placement=Placement(
                dp_size=world, all_reduce=all_reduce_sum, sync_max=lambda k: all_reduce_max_int(k, CPU)
            ),
        ),
    )


def main(engine_name: str, out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, _ = load_config(
        "tiny_klppo",
        [
            f"actor_rollout_ref.rollout.name={engine_name}",
            f"data.max_prompt_length={P}",
            f"data.max_response_length={R}",
        ],
    )
    temperature = 0.8
    cfg.actor_rollout_ref.actor.optim.lr = 3e-2
    actor = sharded_fp32_actor(cfg, world, temperature)
    engine = make_engine(cfg, "tiny://qwen2", CPU)
    torch.manual_seed(1234)  # vLLM re-seeds the global RNG when it starts

    g = torch.Generator().manual_seed(rank)
    prompts = [
        torch.randint(1, 256, (int(n),), generator=g).tolist() for n in torch.randint(2, P + 1, (4,), generator=g)
    ]
    greedy = Sampling(n=1, temperature=0.0, max_tokens=R, do_sample=False)
    sample = Sampling(n=2, temperature=temperature, top_p=1.0, top_k=-1, max_tokens=R)
    res: dict = {"rank": rank, "engine": engine_name}
    if engine_name == "vllm":  # what the engine was built with under the external launcher
        res["disable_custom_all_reduce"] = engine.llm.llm_engine.vllm_config.parallel_config.disable_custom_all_reduce

    def check(tag: str) -> None:
        state = full_model_state(actor.model)  # collective
        full = {k: v for k, v in state.items()}
        states = [None] * world
        dist.all_gather_object(states, full if rank == 0 else None)
        ref_state = states[0]
        t = sync_weights_to_rollout(actor.model, engine, torch.float32, bucket_mb=0.05)
        outs = engine.generate(prompts, greedy)
        hf = hf_greedy(ref_state, prompts, R)
        sampled = engine.generate(prompts, sample)
        flat_prompts = [p for p in prompts for _ in range(sample.n)]
        flat = [r for group in sampled for r in group]
        res[tag] = {
            "greedy_equal": [o[0].token_ids == h for o, h in zip(outs, hf)],
            "greedy": [o[0].token_ids for o in outs],
            "finish": [o[0].finish_reason for o in outs],
            "n_per_prompt": [len(group) for group in sampled],
            "sampled_lengths": [len(r.token_ids) for r in flat],
            "mismatch": engine_vs_actor(actor, flat_prompts, flat),
            "sync_s": t["timing_s/update_weights"],
        }

    check("initial")
    # change the actor's weights with a real PPO update, then sync again
    batch = make_padded_batch(prompts, [[5, 6, 7, 8]] * len(prompts), 0, P, R)
    lp, _ = actor.compute_log_prob(batch, 4)
    batch.update(old_log_probs=lp, advantages=torch.randn(len(prompts), R, generator=g) * batch["response_mask"])
    for _ in range(3):
        actor.update_policy(batch, len(prompts))
    check("after_update")
    res["outputs_changed"] = res["initial"]["greedy"] != res["after_update"]["greedy"]

    # bucket smaller than the largest tensor vs larger than the whole model: the same tensors
    small = dict(stream_full_params(actor.model, torch.float32, bucket_mb=0.001))
    large = dict(stream_full_params(actor.model, torch.float32, bucket_mb=10_000))
    full = full_model_state(actor.model)
    ref = [None] * world
    dist.all_gather_object(ref, full if rank == 0 else None)
    res["buckets_identical"] = small.keys() == large.keys() == ref[0].keys() and all(
        torch.equal(small[k], large[k]) and torch.equal(small[k], ref[0][k]) for k in small
    )
    sync_weights_to_rollout(actor.model, engine, torch.float32, bucket_mb=0.001)
    a = engine.generate(prompts, greedy)
    sync_weights_to_rollout(actor.model, engine, torch.float32, bucket_mb=10_000)
    b = engine.generate(prompts, greedy)
    # same weights in the engine -> bit-identical greedy tokens and log-probs
    res["engine_same_after_small_and_large_bucket"] = all(
        x[0].token_ids == y[0].token_ids and x[0].logprobs == y[0].logprobs for x, y in zip(a, b)
    )
    bf16 = dict(stream_full_params(actor.model, torch.bfloat16, bucket_mb=0.01))
    res["cast_dtype"] = str(next(iter(bf16.values())).dtype)

    # loud failures
    errors = {}
    for tag, name_map in (
        ("bad_name", lambda n: "bogus." + n),
        ("bad_shape", lambda n: n.replace("q_proj.weight", "k_proj.weight")),
    ):
        try:
            sync_weights_to_rollout(actor.model, engine, torch.float32, 1.0, name_map=name_map)
            errors[tag] = None
        except Exception as e:  # noqa: BLE001 - the test reads the message
            errors[tag] = f"{type(e).__name__}: {e}"
    res["errors"] = errors

    everyone = [None] * world
    dist.all_gather_object(everyone, res)
    if rank == 0:
        (out / f"{engine_name}.json").write_text(json.dumps(everyone, indent=1))
    dist.barrier()
    engine.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
    exit_process(0)
