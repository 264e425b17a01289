"""Ulysses sequence parallelism against sp=1, under torchrun on CPU (gloo); test_sequence_parallel.py
runs it.

    torchrun --nproc-per-node=4 tests/dist_sp_checks.py OUT

4 ranks, an HSDP mesh (replicate 2 x shard 2), the tiny Qwen2 (4 query heads, 2 KV heads: sp=4
repeats each KV head twice) with activation checkpointing. For sp = 1, 2, 4 in turn: a fresh
actor and critic, the same rows per rank, then old log-probs, entropies and sum pi^2 (token-budget
micro-batches), one actor update (one row per micro-batch: every row is split over the sp ranks,
and a slice may hold prompt tokens only), values and one critic update (token budget). Rank 0
writes OUT/sp.json: for sp=2 and sp=4 the largest absolute difference from sp=1 of each output
(and the sizes those differences are measured against); the test module asserts on them. Then
for sp = 1, 2 the tiny Qwen3-MoE under routing replay (``run_moe``), in ``moe``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf_hpc.config.schema import ActorConfig, CriticConfig, FSDPConfig, MixedPrecisionConfig
from rlhf_hpc.distributed.fsdp import parallelize
from rlhf_hpc.distributed.process_group import all_reduce_max_int, all_reduce_sum, build_train_mesh, exit_process
from rlhf_hpc.distributed.sequence_parallel import build_sequence_parallel, gather_rows
from rlhf_hpc.models.hf import build_causal_lm, build_critic
from rlhf_hpc.ops.batching import make_padded_batch, select_rows
from rlhf_hpc.ppo import checkpoint as ckpt
from rlhf_hpc.ppo.actor import Actor, ActorSpec, per_token_logprobs
from rlhf_hpc.ppo.critic import Critic, CriticSpec
from rlhf_hpc.ppo.optim import build_optimizer
from rlhf_hpc.ppo.update import Placement

ROWS, P, R, PER_RANK_MINI, FSDP_SIZE = 16, 32, 24, 2, 2
FP32 = MixedPrecisionConfig(param_dtype="float32", reduce_dtype="float32")
CPU = torch.device("cpu")


def rows_of(rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's rows: long prompts (16-32 tokens), responses of 1-24 tokens."""
    g = torch.Generator().manual_seed(7)
    plen = torch.randint(16, P + 1, (ROWS,), generator=g)
    rlen = torch.randint(1, R + 1, (ROWS,), generator=g)
    prompts = [torch.randint(1, 256, (int(n),), generator=g).tolist() for n in plen]
    resps = [torch.randint(1, 256, (int(n),), generator=g).tolist() for n in rlen]
    b = make_padded_batch(prompts, resps, 0, P, R)
    b["advantages"] = torch.randn(ROWS, R, generator=g) * b["response_mask"]
    b["returns"] = torch.randn(ROWS, R, generator=g) * b["response_mask"]
    b["ref_log_prob"] = -torch.rand(ROWS, R, generator=g) * 5 * b["response_mask"]
    per = ROWS // world
    return select_rows(b, list(range(rank * per, (rank + 1) * per)))


def shard(model, world: int):
    parallelize(
        model,
        build_train_mesh(CPU, world, FSDP_SIZE),
        FSDPConfig(fsdp_size=FSDP_SIZE, mixed_precision=FP32),
        CPU,
        gradient_checkpointing=True,
    )
    return model


def placement(world: int, sp_size: int) -> Placement:
    return Placement(
        dp_size=world,
        all_reduce=all_reduce_sum,
        sync_max=lambda k: all_reduce_max_int(k, CPU),
        sp=build_sequence_parallel(sp_size),
    )


def gathered(t: torch.Tensor) -> torch.Tensor:
    """(B, R) per rank -> every rank's rows, in rank order."""
    parts = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def run(sp_size: int, rank: int, world: int) -> dict:
    out: dict = {}
    local = rows_of(rank, world)
    cfg = ActorConfig(
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        entropy_coeff=0.01,
        loss_agg_mode="seq-mean-token-mean",
    )
    cfg.optim.lr, cfg.optim.weight_decay = 1e-3, 0.01
    model = shard(build_causal_lm("tiny://qwen2", torch.float32, seed=0, attn="varlen"), world)
    actor = Actor(
        model,
        cfg,
        ActorSpec(
            temperature=0.8,
            optimizer=build_optimizer(model, cfg.optim),
            norm_const=R,
            placement=placement(world, sp_size),
        ),
    )
    lp, ent, spi2 = actor.compute_log_prob(
        local,
        micro_batch_size=4,
        use_dynamic_bsz=True,
        max_token_len=P + R,
        with_entropy=True,
        with_sum_pi_squared=True,
    )
    out["log_probs"], out["entropy"], out["sum_pi_squared"] = gathered(lp), gathered(ent), gathered(spi2)
    local["old_log_probs"] = lp + 0.05 * local["response_mask"]  # ratio != 1: clipping is exercised
    seen: list[int] = []  # tokens of each forward on this rank: the slice, under sp
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, y: seen.append(args[0].shape[1]))
    out["actor_metrics"] = actor.update_policy(local, PER_RANK_MINI)
    hook.remove()
    out["update_forward_tokens_max"] = all_reduce_max_int(max(seen), CPU)
    out["actor_params"] = ckpt.full_model_state(actor.model)
    lp_after, _ = actor.compute_log_prob(local, micro_batch_size=2)
    out["log_probs_after"] = gathered(lp_after)
    del actor, model

    ccfg = CriticConfig(
        ppo_micro_batch_size_per_gpu=2,
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=P + R,
        forward_max_token_len_per_gpu=P + R,
        ppo_epochs=1,
        shuffle=False,
        loss_agg_mode="token-mean",
    )
    ccfg.optim.lr = 1e-3
    init = build_causal_lm("tiny://qwen2", torch.float32, seed=0, attn="varlen")
    cmodel = shard(build_critic("tiny://qwen2", torch.float32, seed=1, attn="varlen", init_from=init), world)
    critic = Critic(
        cmodel,
        ccfg,
        CriticSpec(optimizer=build_optimizer(cmodel, ccfg.optim), norm_const=R, placement=placement(world, sp_size)),
    )
    values = critic.compute_values(local, micro_batch_size=2)
    out["values"] = gathered(values)
    local["values"] = values
    out["critic_metrics"] = critic.update_critic(local, PER_RANK_MINI)
    out["critic_params"] = ckpt.full_model_state(critic.model)
    return out


def run_moe(sp_size: int, rank: int, world: int) -> dict:
    """The tiny Qwen3-MoE (8 experts, 2 per token) under routing replay: the old-log-prob pass
    recording the actor's own routing (router_replay R2, token-budget micro-batches), then one pass
    over the group's rows replaying a random routing (what R3 and R2's update do)."""
    local = rows_of(rank, world)
    model = shard(build_causal_lm("tiny://qwen3_moe", torch.float32, seed=0, attn="varlen"), world)
    actor = Actor(model, ActorConfig(), ActorSpec(placement=placement(world, sp_size), routing="record"))
    recorded: list = []
    lp, _ = actor.compute_log_prob(
        local, micro_batch_size=4, use_dynamic_bsz=True, max_token_len=P + R, routing_out=recorded
    )
    g = torch.Generator().manual_seed(11 + rank)  # (each rank its own rows' targets)
    layers, k = recorded[0].shape[2:]
    targets = torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(ROWS * (P + R) * layers)])
    local["actor_routed_experts"] = targets.view(-1, P + R, layers, k)[: len(lp)].to(torch.int16)
    local["actor_routed_experts"][~local["attention_mask"].bool()] = 0
    rows, own = (local, slice(None)) if actor.sp is None else gather_rows(local, actor.sp)
    with torch.no_grad():
        replayed, _ = per_token_logprobs(
            actor.model, rows, sp=actor.sp, routing=actor.routing, routing_key="actor_routed_experts"
        )
    agreed, counted = actor.routing.take_agreement()
    tally = all_reduce_sum(torch.tensor([agreed, counted], dtype=torch.float64)).tolist()
    return {
        "moe_log_probs": gathered(lp),
        "moe_routing": gathered(recorded[0].to(torch.int32)),
        "moe_replayed_log_probs": gathered(replayed[own]),
        # each token counted once over the ranks (an sp group's ranks count their own slices)
        "moe_agreement": tally[0] / tally[1],
        "moe_counted": tally[1],
    }


def run_init_params(rank: int, world: int) -> tuple[dict, dict]:
    """The parameters before any update (to show the updates compared are not zero)."""
    model = shard(build_causal_lm("tiny://qwen2", torch.float32, seed=0, attn="varlen"), world)
    init = build_causal_lm("tiny://qwen2", torch.float32, seed=0, attn="varlen")
    cmodel = shard(build_critic("tiny://qwen2", torch.float32, seed=1, attn="varlen", init_from=init), world)
    return ckpt.full_model_state(model), ckpt.full_model_state(cmodel)


def max_diff(a, b) -> float:
    if isinstance(a, dict):
        return max(max_diff(a[k], b[k]) for k in a)
    return (torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().max().item()


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = {sp: run(sp, rank, world) for sp in (1, 2, 4)}
    for sp in (1, 2):  # (4 query and 2 KV heads in Qwen3-MoE's tiny config too: sp=2 splits them)
        runs[sp].update(run_moe(sp, rank, world))
    base, init = runs[1], run_init_params(rank, world)
    res: dict = {
        "row_tokens": rows_of(0, 1)["attention_mask"].sum(-1).tolist(),
        # what the differences are measured against: sizes of the sp=1 outputs and updates
        "scale": {
            "log_probs": base["log_probs"].abs().max().item(),
            "entropy": base["entropy"].abs().max().item(),
            "sum_pi_squared": base["sum_pi_squared"].abs().max().item(),
            "values": base["values"].abs().max().item(),
            "actor_update": max_diff(base["actor_params"], init[0]) if rank == 0 else None,
            "critic_update": max_diff(base["critic_params"], init[1]) if rank == 0 else None,
            "actor_metrics": base["actor_metrics"],
            "critic_metrics": base["critic_metrics"],
        },
    }
    res["update_forward_tokens_max"] = {sp: runs[sp].pop("update_forward_tokens_max") for sp in runs}
    res["moe"] = {
        "log_probs_scale": base["moe_log_probs"].abs().max().item(),
        "replay_moved": max_diff(base["moe_replayed_log_probs"], base["moe_log_probs"]),
        "routed_tokens": int((base["moe_routing"] != 0).any(-1).any(-1).sum()),
        **{
            f"sp{sp}_{k}": max_diff(runs[sp][f"moe_{k}"], base[f"moe_{k}"])
            for sp in (2,)
            for k in ("log_probs", "routing", "replayed_log_probs", "agreement", "counted")
        },
        "agreement": base["moe_agreement"],
        "counted": base["moe_counted"],
    }
    for sp in runs:
        for k in [k for k in runs[sp] if k.startswith("moe_")]:
            runs[sp].pop(k)
    for sp in (2, 4):
        res[f"sp{sp}"] = {k: max_diff(runs[sp][k], base[k]) for k in base if rank == 0 or not k.endswith("_params")}
        res[f"sp{sp}"]["metric_diffs"] = {
            k: abs(runs[sp][m][k] - base[m][k]) for m in ("actor_metrics", "critic_metrics") for k in base[m]
        }
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "sp.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()
    exit_process(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
