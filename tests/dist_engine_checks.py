"""Checks of the FSDP2 engine under torchrun (gloo, CPU); test_engine_dist.py runs and reads them.

    torchrun --nproc-per-node=4 tests/dist_engine_checks.py train OUT   # equivalence, save
    torchrun --nproc-per-node=2 tests/dist_engine_checks.py reload OUT  # load on 2 ranks, export

Rank 0 writes OUT/<phase>.json with the measured differences; the test module asserts on them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from rlhf_hpc.config.schema import ActorConfig, CriticConfig, FSDPConfig, MixedPrecisionConfig
from rlhf_hpc.distributed.fsdp import gradient_reduction, host_replicas, parallelize
from rlhf_hpc.distributed.host_allreduce import MIN_CAPACITY, SHM_DIR, SharedMemoryAllReduce
from rlhf_hpc.distributed.process_group import all_reduce_max_int, all_reduce_sum, build_train_mesh, exit_process
from rlhf_hpc.models.hf import build_causal_lm, build_critic
from rlhf_hpc.ops.batching import make_padded_batch, select_rows
from rlhf_hpc.ppo import checkpoint as ckpt
from rlhf_hpc.ppo.actor import Actor, ActorSpec
from rlhf_hpc.ppo.critic import Critic, CriticSpec
from rlhf_hpc.ppo.optim import build_optimizer
from rlhf_hpc.ppo.update import Placement
from rlhf_hpc.recipe.load import load_config, write_resolved

ROWS, P, R, PER_RANK_MINI = 16, 8, 6, 2
FP32 = MixedPrecisionConfig(param_dtype="float32", reduce_dtype="float32")
CPU = torch.device("cpu")


def global_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    plen = torch.randint(1, P + 1, (ROWS,), generator=g)
    rlen = torch.randint(1, R + 1, (ROWS,), generator=g)
    prompts = [torch.randint(1, 256, (int(n),), generator=g).tolist() for n in plen]
    resps = [torch.randint(1, 256, (int(n),), generator=g).tolist() for n in rlen]
    b = make_padded_batch(prompts, resps, 0, P, R)
    b["advantages"] = torch.randn(ROWS, R, generator=g) * b["response_mask"]
    b["returns"] = torch.randn(ROWS, R, generator=g) * b["response_mask"]
    b["values"] = torch.randn(ROWS, R, generator=g) * 0.1 * b["response_mask"]
    b["ref_log_prob"] = -torch.rand(ROWS, R, generator=g) * 5 * b["response_mask"]
    return b


def rank_rows(rank: int, world: int) -> list[int]:
    per = ROWS // world
    return list(range(rank * per, (rank + 1) * per))


def reference_order(world: int) -> list[int]:
    """Rows in the order that makes reference mini-batch k the union of every rank's mini-batch k."""
    per = ROWS // world
    return [
        rank * per + k * PER_RANK_MINI + i
        for k in range(per // PER_RANK_MINI)
        for rank in range(world)
        for i in range(PER_RANK_MINI)
    ]


def full_grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def actor_cfg(**kw) -> ActorConfig:
    cfg = ActorConfig(
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        entropy_coeff=0.01,
        **kw,
    )
    cfg.optim.lr, cfg.optim.weight_decay = 1e-3, 0.01
    return cfg


def sharded_actor(
    cfg: ActorConfig, fsdp_size: int, world: int, remove_padding: bool = True, shared_memory: bool = True
) -> Actor:
    model = build_causal_lm("tiny://qwen2", torch.float32, seed=0)
    mesh = build_train_mesh(CPU, world, fsdp_size)
    parallelize(
        model,
        mesh,
        FSDPConfig(fsdp_size=fsdp_size, mixed_precision=FP32),
        CPU,
        gradient_checkpointing=True,
        shared_memory=shared_memory,
    )
    return Actor(
        model,
        cfg,
        ActorSpec(
            temperature=0.8,
            remove_padding=remove_padding,
            optimizer=build_optimizer(model, cfg.optim),
            norm_const=R,
            placement=Placement(
                dp_size=world, all_reduce=all_reduce_sum, sync_max=lambda k: all_reduce_max_int(k, CPU)
            ),
        ),
    )


def run_actor_equivalence(
    name: str, fsdp_size: int, results: dict, rank: int, world: int, shared_memory: bool = True, **cfg_kw
) -> Actor:
    batch = global_batch()
    cfg = actor_cfg(**cfg_kw)
    actor = sharded_actor(cfg, fsdp_size, world, shared_memory=shared_memory)
    local = select_rows(batch, rank_rows(rank, world))
    old_lp, _ = actor.compute_log_prob(local, micro_batch_size=3, use_dynamic_bsz=cfg.use_dynamic_bsz, max_token_len=20)
    local["old_log_probs"] = old_lp + 0.05 * local["response_mask"]  # ratio != 1: clipping is exercised
    sharded_metrics = [actor.update_policy(local, PER_RANK_MINI) for _ in range(3)]
    grads = full_grads(actor.model)
    params = ckpt.full_model_state(actor.model)
    lp_all = [torch.zeros_like(old_lp) for _ in range(world)]
    dist.all_gather(lp_all, old_lp)
    if rank == 0:
        ref_cfg = dataclasses.replace(cfg, use_dynamic_bsz=False, ppo_micro_batch_size_per_gpu=4)
        ref_model = build_causal_lm("tiny://qwen2", torch.float32, seed=0)
        ref = Actor(
            ref_model,
            ref_cfg,
            ActorSpec(
                temperature=0.8, remove_padding=False, optimizer=build_optimizer(ref_model, ref_cfg.optim), norm_const=R
            ),
        )
        order = reference_order(world)
        ref_batch = select_rows(batch, order)
        ref_lp, _ = ref.compute_log_prob(ref_batch, micro_batch_size=16)
        ref_batch["old_log_probs"] = ref_lp + 0.05 * ref_batch["response_mask"]
        ref_metrics = [ref.update_policy(ref_batch, PER_RANK_MINI * world) for _ in range(3)]
        sharded_lp = torch.cat(lp_all)[order]
        results[name] = {
            "logprob_max_diff": (sharded_lp - ref_lp).abs().max().item(),
            "metric_max_diff": {
                k: max(abs(s[k] - r[k]) / max(1.0, abs(r[k])) for s, r in zip(sharded_metrics, ref_metrics))
                for k in (
                    "actor/pg_loss",
                    "actor/kl_loss",
                    "actor/entropy",
                    "actor/grad_norm",
                    "actor/ppo_kl",
                    "actor/pg_clipfrac",
                )
            },
            "pg_clipfrac_max": max(m["actor/pg_clipfrac"] for m in sharded_metrics),
            "grad_max_diff": max_diff(grads, full_grads(ref_model)),
            "param_max_diff": max_diff(params, dict(ref_model.state_dict())),
            "param_moved": max_diff(params, dict(build_causal_lm("tiny://qwen2", torch.float32, seed=0).state_dict())),
            "gradient_reduction": gradient_reduction(actor.model),
        }
    dist.barrier()
    return actor


def run_critic_equivalence(results: dict, rank: int, world: int) -> Critic:
    batch = global_batch()
    cfg = CriticConfig(
        ppo_micro_batch_size_per_gpu=1,
        ppo_epochs=1,
        cliprange_value=0.5,
        use_dynamic_bsz=False,
        shuffle=False,
        loss_agg_mode="token-mean",
    )
    cfg.optim.lr = 1e-3
    actor_init = build_causal_lm("tiny://qwen2", torch.float32, seed=0)
    model = build_critic("tiny://qwen2", torch.float32, seed=1, init_from=actor_init)
    parallelize(model, build_train_mesh(CPU, world, 2), FSDPConfig(fsdp_size=2, mixed_precision=FP32), CPU)
    critic = Critic(
        model,
        cfg,
        CriticSpec(
            remove_padding=True,
            optimizer=build_optimizer(model, cfg.optim),
            placement=Placement(
                dp_size=world, all_reduce=all_reduce_sum, sync_max=lambda k: all_reduce_max_int(k, CPU)
            ),
        ),
    )
    local = select_rows(batch, rank_rows(rank, world))
    values = critic.compute_values(local, micro_batch_size=3)
    metrics = [critic.update_critic(local, PER_RANK_MINI) for _ in range(3)]
    grads, params = full_grads(model), ckpt.full_model_state(model)
    v_all = [torch.zeros_like(values) for _ in range(world)]
    dist.all_gather(v_all, values)
    if rank == 0:
        ref_model = build_critic("tiny://qwen2", torch.float32, seed=1, init_from=actor_init)
        ref = Critic(
            ref_model,
            dataclasses.replace(cfg, ppo_micro_batch_size_per_gpu=8),
            CriticSpec(remove_padding=False, optimizer=build_optimizer(ref_model, cfg.optim)),
        )
        order = reference_order(world)
        ref_batch = select_rows(batch, order)
        ref_values = ref.compute_values(ref_batch, micro_batch_size=16)
        ref_metrics = [ref.update_critic(ref_batch, PER_RANK_MINI * world) for _ in range(3)]
        results["critic_2x2"] = {
            "value_max_diff": (torch.cat(v_all)[order] - ref_values).abs().max().item(),
            "metric_max_diff": {
                k: max(abs(s[k] - r[k]) / max(1.0, abs(r[k])) for s, r in zip(metrics, ref_metrics))
                for k in ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/vpred_mean")
            },
            "vf_clipfrac_max": max(m["critic/vf_clipfrac"] for m in metrics),
            "grad_max_diff": max_diff(grads, full_grads(ref_model)),
            "param_max_diff": max_diff(params, dict(ref_model.state_dict())),
        }
    dist.barrier()
    return critic


def check_shared_memory_mean(rank: int, world: int) -> dict:
    """SharedMemoryAllReduce against gloo's all-reduce: 1 MiB buckets (so tensors span buckets and
    buckets alternate halves over calls), fp32 and bf16; when it declines; a rank with other sizes."""
    group = dist.new_group(list(range(world)))
    shm, why = SharedMemoryAllReduce.create(group, capacity=MIN_CAPACITY)
    out: dict = {"why": why, "max_diff": {}}
    g = torch.Generator().manual_seed(100 + rank)  # every rank its own values
    for dtype in (torch.float32, torch.bfloat16):
        for call in range(3):
            tensors = [torch.randn(n, generator=g).to(dtype) for n in (7, 300_001, 1, 2 * MIN_CAPACITY // 4 + 3)]
            expected = [t.float().clone() for t in tensors]  # .float() of fp32 is the tensor itself
            for t in expected:
                dist.all_reduce(t)
            shm.mean_(tensors)
            diff = max((t.float() - e / world).abs().max().item() for t, e in zip(tensors, expected))
            key = str(dtype).removeprefix("torch.")
            out["max_diff"][key] = max(out["max_diff"].get(key, 0.0), diff)
    try:
        shm.mean_([torch.zeros(10 + rank)])
        out["unequal_sizes"] = None
    except RuntimeError as e:
        out["unequal_sizes"] = str(e)
    out["after_error"] = _mean_is_right(shm, rank, world)
    out["two_hosts"] = SharedMemoryAllReduce.create(group, host=f"node{rank % 2}")[1]
    out["no_shm_dir"] = SharedMemoryAllReduce.create(group, shm_dir=Path("/nonexistent-shm"))[1]
    # the creating rank (group rank 0) unlinks its files once every rank has mapped them
    out["files_left"] = sorted(p.name for p in SHM_DIR.glob(f"rlhf_hpc_allreduce_{os.getpid()}_*"))
    return out


def _mean_is_right(shm, rank: int, world: int) -> bool:
    t = [torch.full((1000,), float(rank))]
    shm.mean_(t)
    return bool((t[0] == sum(range(world)) / world).all())


def full_train_state(model, optimizer):
    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def phase_train(out: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict = {}
    actor = run_actor_equivalence("actor_2x2", 2, results, rank, world)
    run_actor_equivalence("actor_1x4", -1, results, rank, world)
    # replicated (the layout rlhf_hpc.planning.layout picks for small models): one all-reduce per mini-batch,
    # through shared memory (all ranks on this machine), and by gloo where shared memory is not used
    replicated = run_actor_equivalence("actor_4x1", 1, results, rank, world)
    run_actor_equivalence("actor_4x1_gloo", 1, results, rank, world, shared_memory=False)
    run_actor_equivalence(
        "actor_2x2_dynamic_bsz", 2, results, rank, world, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=20
    )
    critic = run_critic_equivalence(results, rank, world)
    results["shared_memory_mean"] = check_shared_memory_mean(rank, world)
    # which meshes and settings the host-replica gradient path takes (the rest is FSDP2's HSDP)
    mesh_4x1, mesh_2x2 = build_train_mesh(CPU, world, 1), build_train_mesh(CPU, world, 2)
    results["host_replicas"] = {
        "4x1": host_replicas(mesh_4x1, FSDPConfig(mixed_precision=FP32), CPU) is not None,
        "4x1_bf16_compute": host_replicas(mesh_4x1, FSDPConfig(), CPU) is not None,
        "4x1_bf16_reduce": host_replicas(
            mesh_4x1, FSDPConfig(mixed_precision=MixedPrecisionConfig(reduce_dtype="bfloat16")), CPU
        )
        is not None,
        "4x1_offload": host_replicas(mesh_4x1, FSDPConfig(param_offload=True), CPU) is not None,
        "4x1_reshard_after_forward": host_replicas(
            mesh_4x1, FSDPConfig(mixed_precision=FP32, reshard_after_forward=True), CPU
        )
        is not None,
        "4x1_forward_prefetch": host_replicas(mesh_4x1, FSDPConfig(mixed_precision=FP32, forward_prefetch=True), CPU)
        is not None,
        "2x2": host_replicas(mesh_2x2, FSDPConfig(mixed_precision=FP32), CPU) is not None,
    }

    # ---- sharded checkpoint on the 2x2 mesh, then a save that dies half-way
    run = out / "run"
    if rank == 0:
        write_resolved(
            load_config(
                "tiny_klppo", [f"trainer.default_local_dir={run}", "actor_rollout_ref.model.path=tiny://qwen2"]
            )[0],
            run,
        )
    dist.barrier()
    components = {"actor": (actor.model, actor.optimizer), "critic": (critic.model, critic.optimizer)}
    ckpt.save_checkpoint(run, 3, components, extra={"global_step": 3, "kl_ctrl": {"value": 0.01}})
    msd, osd = full_train_state(actor.model, actor.optimizer)
    if rank == 0:
        torch.save({"model": msd, "optim": osd}, out / "actor_full_state.pt")
    # the replicated actor (host replicas: every rank's FSDP2 mesh is itself) saves too: reloaded sharded
    ckpt.save_checkpoint(out / "replicated", 3, {"actor": (replicated.model, replicated.optimizer)}, extra={})
    msd, osd = full_train_state(replicated.model, replicated.optimizer)
    if rank == 0:
        torch.save({"model": msd, "optim": osd}, out / "actor_4x1_full_state.pt")

    def die_after_actor(name: str) -> None:  # the process "dies" after the actor's shards are written
        if name == "actor":
            raise RuntimeError("simulated crash during checkpoint write")

    crashed = False
    try:
        ckpt.save_checkpoint(run, 4, components, extra={"global_step": 4}, after_component=die_after_actor)
    except RuntimeError:
        crashed = True
    dist.barrier()
    if rank == 0:
        results["crash_during_save"] = {
            "crashed": crashed,
            "latest": str(ckpt.latest_checkpoint(run)),
            "complete": ckpt.list_checkpoints(run),
            "tmp_left": (run / ".tmp-global_step_4").exists(),
        }
    # retention: keep the newest two
    keep_root = out / "keep"
    for step in (1, 2, 3):
        ckpt.save_checkpoint(keep_root, step, {"critic": (critic.model, None)}, extra={}, max_to_keep=2)
    if rank == 0:
        results["retention"] = ckpt.list_checkpoints(keep_root)
        (out / "train.json").write_text(json.dumps(results, indent=1))


def phase_reload(out: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    run = out / "run"
    cfg = actor_cfg()
    actor = sharded_actor(cfg, -1, world)  # 1 x 2 mesh: different world size and mesh
    latest = ckpt.latest_checkpoint(run)
    extra = ckpt.load_checkpoint(latest, {"actor": (actor.model, actor.optimizer)})
    msd, osd = full_train_state(actor.model, actor.optimizer)
    # across layouts: the 2x2 checkpoint into a replicated 2x1 actor (host replicas), and the replicated
    # 4x1 one into a 1x2 sharded actor
    across = {}
    for name, fsdp_size, saved_by in (("2x2_into_2x1", 1, run), ("4x1_into_1x2", -1, out / "replicated")):
        other = sharded_actor(cfg, fsdp_size, world)
        ckpt.load_checkpoint(ckpt.latest_checkpoint(saved_by), {"actor": (other.model, other.optimizer)})
        across[name] = (gradient_reduction(other.model), *full_train_state(other.model, other.optimizer))
    batch = global_batch()
    with torch.no_grad():
        logits = actor.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits
    if rank == 0:
        saved = torch.load(out / "actor_full_state.pt", weights_only=True)
        params_equal, optim_equal = bit_exact(saved, msd, osd)
        flat_saved = _flatten(saved["optim"])
        n_optim_tensors = sum(isinstance(v, torch.Tensor) for v in flat_saved.values())
        saved_4x1 = torch.load(out / "actor_4x1_full_state.pt", weights_only=True)
        across_layouts = {
            name: [reduction, *bit_exact(saved if name.startswith("2x2") else saved_4x1, m, o)]
            for name, (reduction, m, o) in across.items()
        }
        from transformers import AutoModelForCausalLM

        hf_dir = ckpt.export_hf(latest, out / "hf", dtype="float32")
        exported = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        with torch.no_grad():
            hf_logits = exported(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
            ).logits
        results = {
            "loaded_step": latest.name,
            "checkpoint": str(latest),
            "extra": extra,
            "params_bit_exact": params_equal,
            "optim_bit_exact": optim_equal,
            "n_optim_tensors": n_optim_tensors,
            "export_logits_max_diff": (hf_logits - logits).abs().max().item(),
            "export_files": sorted(p.name for p in hf_dir.iterdir()),
            "across_layouts": across_layouts,
        }
        (out / "reload.json").write_text(json.dumps(results, indent=1))
    dist.barrier()


def bit_exact(saved: dict, msd: dict, osd: dict) -> tuple[bool, bool]:
    """(parameters, optimizer state) of a full train state equal, bit for bit, to ``saved``'s."""
    params = saved["model"].keys() == msd.keys() and all(torch.equal(saved["model"][k], msd[k]) for k in msd)
    flat_saved, flat_now = _flatten(saved["optim"]), _flatten(osd)
    optim = flat_saved.keys() == flat_now.keys() and all(
        torch.equal(flat_saved[k], flat_now[k])
        if isinstance(flat_saved[k], torch.Tensor)
        else flat_saved[k] == flat_now[k]
        for k in flat_saved
    )
    return params, optim


def _flatten(tree, prefix=""):
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}/{k}"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_flatten(v, f"{prefix}/{i}"))
    else:
        out[prefix] = tree
    return out


if __name__ == "__main__":
    phase, out_dir = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    {"train": phase_train, "reload": phase_reload}[phase](out_dir)
    dist.destroy_process_group()
    exit_process(0)
