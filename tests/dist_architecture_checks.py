"""The architecture matrix under torchrun (2 ranks, gloo, CPU); test_architectures.py runs and reads it.

    torchrun --nproc-per-node=2 tests/dist_architecture_checks.py train OUT   # 1, 2, 4 (and 3 once, sharded)
    python tests/dist_architecture_checks.py rollout OUT                       # 3, one engine at a time

For every tiny architecture of ``rlhf_hpc.models.hf.TINY_MODELS`` (Qwen2 untied and tied, Qwen3, Llama
with llama3 rope scaling, Mistral, Gemma 2, Gemma 3), in one process group:

1. FSDP2 over both ranks (FULL_SHARD, varlen attention, activation checkpointing) against one
   process holding the plain transformers model (eager attention, padded rows, the union of the
   ranks' rows): log-probs, then the parameters after two PPO updates;
2. Ulysses: the same rows with each packed sequence split over the two ranks (sp=2) against sp=1;
3. the weight sync into vLLM (TP=1): the log-probs vLLM reports for its own samples against the
   actor's on the same tokens; and, for a tied head, vLLM's own verdict on a reload that leaves
   the head out (what the sync did before it fed the head). vLLM's teardown ends the process group,
   so this runs in one process, an engine per architecture, and once more on the 2 ranks (an engine
   each, external_launcher) for the tied Qwen2 sharded over both;
4. a sharded checkpoint written on the 1x2 mesh, loaded back into a fresh actor (bit for bit), and
   exported to a Hugging Face directory that transformers loads back (tied where the original is);
5. the model saved as a pretrained checkpoint, read by rank 0 alone and sent to both ranks
   (sharded and replicated), actor and critic, against transformers' own loading.

Rank 0 writes OUT/train.json; the rollout phase OUT/rollout.json.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from rlhf_hpc.config.schema import ActorConfig, FSDPConfig, MixedPrecisionConfig
from rlhf_hpc.distributed.fsdp import parallelize
from rlhf_hpc.distributed.loading import build_sharded
from rlhf_hpc.distributed.process_group import (
    DistContext,
    all_reduce_max,
    all_reduce_max_int,
    all_reduce_sum,
    build_train_mesh,
    exit_process,
)
from rlhf_hpc.distributed.sequence_parallel import build_sequence_parallel
from rlhf_hpc.models.hf import build_causal_lm, build_critic
from rlhf_hpc.ops.batching import make_padded_batch, select_rows
from rlhf_hpc.ppo import checkpoint as ckpt
from rlhf_hpc.ppo.actor import Actor, ActorSpec
from rlhf_hpc.ppo.optim import build_optimizer
from rlhf_hpc.ppo.update import Placement
from rlhf_hpc.recipe.load import load_config, write_resolved
from rlhf_hpc.rollout.base import Sampling, logprob_mismatch
from rlhf_hpc.rollout.factory import make_engine
from rlhf_hpc.rollout.weight_sync import stream_full_params, sync_weights_to_rollout

ARCHS = {
    "qwen2": "tiny://qwen2",
    "qwen2_tied": "tiny://qwen2?tie_word_embeddings=true",
    "qwen3": "tiny://qwen3",
    "llama": "tiny://llama",
    "mistral": "tiny://mistral",
    "gemma2": "tiny://gemma2",
    "gemma3": "tiny://gemma3",
    "qwen3_moe": "tiny://qwen3_moe",
    "mixtral": "tiny://mixtral",
}
# rows of up to 24 + 16 tokens: longer than the Gemma models' sliding window (32 tokens)
ROWS, P, R, PER_RANK_MINI = 8, 24, 16, 2
FP32 = MixedPrecisionConfig(param_dtype="float32", reduce_dtype="float32")
CPU = torch.device("cpu")


def global_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    plen = torch.randint(8, P + 1, (ROWS,), generator=g)
    rlen = torch.randint(1, R + 1, (ROWS,), generator=g)
    prompts = [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in plen]
    resps = [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in rlen]
    b = make_padded_batch(prompts, resps, 0, P, R)
    b["advantages"] = torch.randn(ROWS, R, generator=g) * b["response_mask"]
    b["ref_log_prob"] = -torch.rand(ROWS, R, generator=g) * 5 * b["response_mask"]
    return b


def actor_cfg() -> ActorConfig:
    cfg = ActorConfig(
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        entropy_coeff=0.01,
    )
    cfg.optim.lr, cfg.optim.weight_decay = 1e-3, 0.01
    return cfg


def sharded_actor(path: str, world: int, sp_size: int = 1) -> Actor:
    model = build_causal_lm(path, torch.float32, seed=0, attn="varlen")
    parallelize(
        model,
        build_train_mesh(CPU, world, -1),
        FSDPConfig(fsdp_size=-1, mixed_precision=FP32),
        CPU,
        gradient_checkpointing=True,
    )
    cfg = actor_cfg()
    return Actor(
        model,
        cfg,
        ActorSpec(
            temperature=0.8,
            optimizer=build_optimizer(model, cfg.optim),
            norm_const=R,
            placement=Placement(
                dp_size=world,
                all_reduce=all_reduce_sum,
                sync_max=lambda k: all_reduce_max_int(k, CPU),
                sp=build_sequence_parallel(sp_size),
            ),
        ),
    )


def gathered(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def check_training(path: str, rank: int, world: int, res: dict) -> Actor:
    """1 and 2: sharded (and sequence-parallel) against one process with plain transformers."""
    batch = global_batch()
    per = ROWS // world
    mine = list(range(rank * per, (rank + 1) * per))
    local = select_rows(batch, mine)
    actor = sharded_actor(path, world)
    # a mixture of experts' fused experts (E, ...) are sharded by expert, never replicated
    res["expert_shards"] = {
        n: [list(p.shape), list(p.to_local().shape), [type(pl).__name__ for pl in p.placements]]
        for n, p in actor.model.named_parameters()
        if ".experts." in n and n.startswith("model.layers.0.")
    }
    lp, _ = actor.compute_log_prob(local, micro_batch_size=2)
    sp_actor = sharded_actor(path, world, sp_size=2)
    sp_lp, _ = sp_actor.compute_log_prob(local, micro_batch_size=2)
    del sp_actor
    local["old_log_probs"] = lp + 0.05 * local["response_mask"]  # ratio != 1: clipping is exercised
    for _ in range(2):
        actor.update_policy(local, PER_RANK_MINI)
    params = ckpt.full_model_state(actor.model)
    all_lp, all_sp = gathered(lp), gathered(sp_lp)
    if rank == 0:
        plain = build_causal_lm(path, torch.float32, seed=0, attn="eager")
        before = {k: v.clone() for k, v in plain.state_dict().items()}
        ref = Actor(
            plain,
            dataclasses.replace(actor_cfg(), ppo_micro_batch_size_per_gpu=ROWS),
            ActorSpec(
                temperature=0.8, remove_padding=False, optimizer=build_optimizer(plain, actor_cfg().optim), norm_const=R
            ),
        )
        # reference mini-batch k = the union of every rank's mini-batch k
        order = [
            r * per + k * PER_RANK_MINI + i
            for k in range(per // PER_RANK_MINI)
            for r in range(world)
            for i in range(PER_RANK_MINI)
        ]
        ref_batch = select_rows(batch, order)
        ref_lp, _ = ref.compute_log_prob(ref_batch, micro_batch_size=ROWS)
        ref_batch["old_log_probs"] = ref_lp + 0.05 * ref_batch["response_mask"]
        for _ in range(2):
            ref.update_policy(ref_batch, PER_RANK_MINI * world)
        after = plain.state_dict()
        res.update(
            logprob_max_diff=(all_lp[order] - ref_lp).abs().max().item(),
            ulysses_max_diff=(all_sp - all_lp).abs().max().item(),
            param_max_diff=max_diff(params, after),
            param_moved=max_diff(after, before),
        )
    dist.barrier()
    return actor


def check_rollout(path: str, actor: Actor, res: dict, close: bool = False) -> None:
    """3: the weight sync into vLLM, the engine's log-probs of its own samples against the actor's.
    Every rank of the process group (if any) has its own engine. vLLM's teardown ends the process
    group, so an engine is closed only where nothing distributed follows (``close``)."""
    cfg, _ = load_config(
        "tiny_klppo",
        [
            "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.model.path={path}",
            f"data.max_prompt_length={P}",
            f"data.max_response_length={R}",
        ],
    )
    engine = make_engine(cfg, path, CPU)
    torch.manual_seed(1234)  # vLLM re-seeds the global RNG when it starts
    g = torch.Generator().manual_seed(dist.get_rank() if dist.is_initialized() else 0)
    prompts = [
        torch.randint(3, 256, (int(n),), generator=g).tolist() for n in torch.randint(8, P + 1, (4,), generator=g)
    ]
    if engine.tied_aliases:  # a tied head vLLM holds as its own layer: what the sync did before it fed it
        from rlhf_hpc.rollout.vllm_engine import ReloadVerdicts

        first_names = iter(list(stream_full_params(actor.model, torch.float32, bucket_mb=1.0)))
        with ReloadVerdicts(engine.param_layers) as verdicts:
            engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": first_names})
        res["without_head"] = verdicts.problems
    sync_weights_to_rollout(actor.model, engine, torch.float32, bucket_mb=0.05)
    sampled = engine.generate(prompts, Sampling(n=2, temperature=0.8, max_tokens=R))
    flat_prompts = [p for p in prompts for _ in range(2)]
    flat = [r for group in sampled for r in group]
    batch = make_padded_batch(flat_prompts, [r.token_ids for r in flat], 0, P, R)
    lp, _ = actor.compute_log_prob(batch, micro_batch_size=8)
    engine_lp = torch.zeros_like(lp)
    for i, r in enumerate(flat):
        engine_lp[i, : len(r.logprobs)] = torch.tensor(r.logprobs)
    reduce = dict(all_reduce_sum=all_reduce_sum, all_reduce_max=all_reduce_max) if dist.is_initialized() else {}
    res["rollout"] = logprob_mismatch(engine_lp, lp, batch["response_mask"], **reduce)
    res["fed_aliases"] = dict(engine.tied_aliases)
    res["sampled_tokens"] = int(batch["response_mask"].sum())
    if close:
        engine.close()


def check_checkpoint(name: str, path: str, actor: Actor, out: Path, rank: int, world: int, res: dict) -> None:
    """4: save on the 1x2 mesh, load into a fresh actor, export to Hugging Face."""
    run = out / name
    if rank == 0:
        write_resolved(
            load_config("tiny_klppo", [f"trainer.default_local_dir={run}", f"actor_rollout_ref.model.path={path}"])[0],
            run,
        )
    dist.barrier()
    saved_at = ckpt.save_checkpoint(run, 2, {"actor": (actor.model, actor.optimizer)}, extra={"global_step": 2})
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(actor.model, actor.optimizer, options=opts)
    fresh = sharded_actor(path, world)
    ckpt.load_checkpoint(saved_at, {"actor": (fresh.model, fresh.optimizer)})
    msd2, osd2 = get_state_dict(fresh.model, fresh.optimizer, options=opts)
    if rank == 0:
        res["resume_params_bit_exact"] = msd.keys() == msd2.keys() and all(torch.equal(msd[k], msd2[k]) for k in msd)
        state, state2 = osd["state"], osd2["state"]
        res["resume_optimizer_bit_exact"] = state.keys() == state2.keys() and all(
            torch.equal(state[k][s], state2[k][s]) for k in state for s in state[k]
        )
        from transformers import AutoModelForCausalLM

        hf_dir = ckpt.export_hf(saved_at, out / f"{name}-hf", dtype="float32")
        # eager as the reference: transformers' sdpa drops Gemma 2's attention soft-capping
        exported = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
        plain = build_causal_lm(path, torch.float32, seed=0, attn="eager")
        plain.load_state_dict(msd)
        batch = global_batch()
        with torch.no_grad():
            a = exported(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            b = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        valid = batch["attention_mask"].bool()  # (a padding position's logits depend on the attention kernel)
        res["export"] = {
            "logits_max_diff": (a - b)[valid].abs().max().item(),
            "class": type(exported).__name__,
            "tied": exported.get_output_embeddings().weight is exported.get_input_embeddings().weight,
            "config_tied": bool(exported.config.tie_word_embeddings),
            "original_tied": plain.get_output_embeddings().weight is plain.get_input_embeddings().weight,
        }
    dist.barrier()


def check_load_once(name: str, path: str, out: Path, rank: int, world: int, res: dict) -> None:
    """5: a pretrained checkpoint read by rank 0 alone (rlhf_hpc.distributed.loading), sharded (FSDP2),
    replicated on the host and sharded on the host (param_offload; the causal LM frozen), against
    ``from_pretrained`` in one process: weights, buffers, the tie."""
    saved = out / f"{name}-pretrained"
    if rank == 0:
        build_causal_lm(path, torch.float32, seed=0).save_pretrained(saved)
    dist.barrier()
    ctx = DistContext(rank=rank, world_size=world, local_rank=rank, device=CPU, backend="gloo")
    found = {}
    # "offloaded": shards on the host (param_offload, FSDP2's CPUOffloadPolicy), the causal LM frozen
    # as a reference is: the broadcast runs on the job's device, each slice is copied to the host
    for layout, fsdp_size, offload in (("sharded", -1, False), ("replicated", 1, False), ("offloaded", -1, True)):
        fsdp = FSDPConfig(fsdp_size=fsdp_size, mixed_precision=FP32, param_offload=offload)
        model = build_sharded(
            lambda device: build_causal_lm(str(saved), torch.float32, device, attn="varlen"),
            fsdp,
            ctx,
            gradient_checkpointing=False,
            from_checkpoint=True,
            frozen=offload,
        )
        critic = build_sharded(
            lambda device: build_critic(str(saved), torch.float32, device, seed=1),
            fsdp,
            ctx,
            gradient_checkpointing=False,
            from_checkpoint=True,
        )
        found[layout] = (
            ckpt.full_model_state(model),
            ckpt.full_model_state(critic),
            dict(model.named_buffers()),
            model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        )
    if rank == 0:
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
        ref_critic = build_critic(str(saved), torch.float32, "cpu", seed=1)
        want, want_critic, want_buffers = ref.state_dict(), ref_critic.state_dict(), dict(ref.named_buffers())
        tied = ref.get_output_embeddings().weight is ref.get_input_embeddings().weight
        res["load_once"] = {
            layout: {
                "params_bit_exact": state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want),
                "critic_bit_exact": cstate.keys() == want_critic.keys()
                and all(torch.equal(cstate[k], want_critic[k]) for k in want_critic),
                "buffers_bit_exact": buffers.keys() == want_buffers.keys()
                and all(torch.equal(buffers[k], want_buffers[k]) for k in want_buffers),
                "tie_kept": is_tied == tied,
            }
            for layout, (state, cstate, buffers, is_tied) in found.items()
        }
    dist.barrier()


def phase_train(out: Path) -> None:
    """1, 2 and 4 for every architecture on 2 ranks; 3 for the tied Qwen2 sharded over both."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name, path in ARCHS.items():
        res: dict = {}
        actor = check_training(path, rank, world, res)
        check_checkpoint(name, path, actor, out, rank, world, res)
        check_load_once(name, path, out, rank, world, res)
        results[name] = res
        if rank == 0:
            print(f"[architectures] {name}: {json.dumps(res)}", flush=True)
        if name == "qwen2_tied":
            tied_actor = actor
    if importlib.util.find_spec("vllm") is not None:
        check_rollout(ARCHS["qwen2_tied"], tied_actor, results.setdefault("sharded_qwen2_tied", {}))
    if rank == 0:
        (out / "train.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def phase_rollout(out: Path) -> None:
    """3 for every architecture in one process (an engine per architecture, each closed after use)."""
    results = {}
    for name, path in ARCHS.items():
        model = build_causal_lm(path, torch.float32, seed=0, attn="varlen")
        actor = Actor(model, actor_cfg(), ActorSpec(temperature=0.8))
        check_rollout(path, actor, results.setdefault(name, {}), close=True)
        print(f"[architectures] {name}: {json.dumps(results[name])}", flush=True)
    (out / "rollout.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    {"train": phase_train, "rollout": phase_rollout}[sys.argv[1]](Path(sys.argv[2]))
    exit_process(0)
