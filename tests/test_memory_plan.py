"""The per-GPU memory plan: shapes from the config alone, what each phase holds, refusals that name
the keys, and the launcher printing it at --dry-run and refusing before anything starts.
(The estimator against measured peaks: python -m benchmarks.memory_plan_check, BENCHMARKS.md.)"""

from __future__ import annotations

import pytest

from rlhf_hpc.planning.memory_plan import build_plan, check_plan
from rlhf_hpc.planning.sizing import GiB, layer_activation_bytes, logits_bytes, model_shape
from rlhf_hpc.recipe.load import load_config
from tests.conftest import launch_here, run_launch


def plan_of(recipe: str, *overrides: str):
    cfg, _ = load_config(recipe, overrides, check_files=False)
    return cfg, build_plan(cfg)


def phase(plan, name: str):
    return next(p for p in plan.phases if p.name == name)


def test_shapes_from_the_published_configs_count_the_real_parameters():
    seven = model_shape("Qwen/Qwen2.5-7B-Instruct")
    assert seven.params == 7_615_616_512  # Qwen2.5-7B's published count
    assert seven.head_params == seven.embed_params == 152064 * 3584  # untied head
    assert model_shape("Qwen/Qwen2.5-0.5B-Instruct").params == 494_032_768
    assert model_shape("Qwen/Qwen2.5-0.5B-Instruct").head_params == 0  # tied to the embedding
    with pytest.raises(FileNotFoundError, match="no config.json at /nowhere/mystery-model"):
        model_shape("/nowhere/mystery-model")


def test_flagship_plan_fits_an_80gb_gpu_and_names_each_phase():
    cfg, plan = plan_of("qwen7b_klppo")
    assert [p.name for p in plan.phases] == ["gen", "old_log_prob", "ref", "values", "update_actor", "update_critic"]
    assert plan.failures() == []
    gen = phase(plan, "gen")
    assert gen.parts["vLLM (gpu_memory_utilization)"] == 0.6 * 80 * GiB
    # optimizer_offload: the actor's Adam state is on the host during generation, on the GPU to update
    assert gen.parts["actor state"] == pytest.approx(7_615_616_512 * 4 / 8)
    assert phase(plan, "update_actor").parts["optimizer"] == pytest.approx(7_615_616_512 * 8 / 8)
    assert "ref params" not in gen.parts or gen.parts["ref params"] == 0.0  # the reference is offloaded


def test_offload_flags_move_state_off_the_gpu():
    _, on = plan_of("qwen7b_klppo", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=false")
    _, off = plan_of("qwen7b_klppo", "actor_rollout_ref.actor.fsdp_config.param_offload=true")
    assert phase(on, "gen").parts["actor state"] == pytest.approx(7_615_616_512 * 12 / 8)
    assert phase(off, "gen").parts["actor state"] == 0.0
    assert phase(off, "update_actor").parts["params"] == phase(off, "update_actor").parts["optimizer"] == 0.0


def test_logits_without_fp32_copies_are_what_keeps_the_old_micro_batch_possible():
    # 40 fixed rows x 512 response tokens: the bf16 logits and their gradient plus one fp32 chunk
    n, V = 40 * 512, 152064
    assert logits_bytes(n, V, 2, with_grad=True) == n * V * 2 * 2 + 1024 * V * 4 * 4
    cfg, plan = plan_of(
        "qwen7b_klppo",
        "actor_rollout_ref.actor.use_dynamic_bsz=false",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
    )
    assert phase(plan, "update_actor").parts["logits"] == logits_bytes(n, V, 2, with_grad=True)
    assert phase(plan, "update_actor").total < 80 * GiB


def test_activation_bytes_per_token_follow_the_block():
    s = model_shape("Qwen/Qwen2.5-7B-Instruct")
    h, i, q, kv = 3584, 18944, 3584, 512
    assert layer_activation_bytes(s, 2) == 16 * h + 2 * (4 * h + 3 * q + 3 * kv + 4 * i)


def test_impossible_generation_phase_is_refused_naming_its_keys():
    cfg, _ = load_config("qwen7b_klppo", ["actor_rollout_ref.rollout.gpu_memory_utilization=0.95"], check_files=False)
    plan, errors, _ = check_plan(cfg)
    assert len(errors) == 1 and errors[0].startswith("memory plan: phase gen needs")
    assert errors[0].endswith(
        "shrink it with actor_rollout_ref.rollout.gpu_memory_utilization, "
        "actor_rollout_ref.actor.fsdp_config.param_offload, "
        "critic.model.fsdp_config.param_offload, critic.model.fsdp_config.optimizer_offload"
    )


def test_update_phase_refusal_names_the_token_budget_and_what_is_still_off():
    cfg, _ = load_config(
        "qwen7b_klppo",
        [
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=200000",
            "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        ],
        check_files=False,
    )
    _, errors, _ = check_plan(cfg)
    (err,) = [e for e in errors if "phase update_actor" in e]
    assert err.endswith(
        "shrink it with actor_rollout_ref.actor.ppo_max_token_len_per_gpu, "
        "actor_rollout_ref.model.enable_gradient_checkpointing, "
        "actor_rollout_ref.actor.fsdp_config.param_offload"
    )


def test_kv_cache_too_small_for_one_sequence_is_refused():
    cfg, _ = load_config(
        "qwen7b_klppo",
        [
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.12",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        ],
        check_files=False,
    )
    _, errors, _ = check_plan(cfg)
    assert any(
        e.startswith(
            "memory plan: phase gen leaves room for a KV cache of 0 tokens per GPU, less than one "
            "sequence (max_model_len 1024)"
        )
        for e in errors
    ), errors


def test_smaller_gpus_are_planned_with_hardware_hbm_gb():
    _, errors, _ = check_plan(load_config("qwen7b_klppo", ["hardware.hbm_gb=40"], check_files=False)[0])
    assert any("but a GPU has 40 GiB" in e for e in errors)


def test_cpu_runs_get_a_plan_but_no_refusal():
    cfg, _ = load_config("tiny_klppo", [], check_files=False)
    plan, errors, warnings = check_plan(cfg)
    assert errors == [] and warnings == [] and plan.render().startswith("# memory plan per rank (host memory)")


def test_dry_run_prints_the_plan_and_refuses_an_impossible_one(tmp_path):
    ok = launch_here("recipe=qwen7b_klppo", "--dry-run", "cluster=local", f"trainer.default_local_dir={tmp_path}/a")
    assert ok.returncode == 0, ok.stderr
    assert "# memory plan per GPU: 80 GiB" in ok.stdout and "# OK   update_actor" in ok.stdout
    bad = launch_here(
        "recipe=qwen7b_klppo",
        "--dry-run",
        "cluster=local",
        f"trainer.default_local_dir={tmp_path}/b",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.95",
    )
    assert bad.returncode == 2
    assert "# FAIL gen" in bad.stdout
    assert "error: invalid configuration: memory plan: phase gen needs" in bad.stderr


@pytest.mark.slow
def test_a_launch_is_refused_before_anything_starts(tmp_path):
    run = tmp_path / "run"
    out = run_launch(
        "recipe=tiny_klppo", "trainer.device=cuda", "hardware.hbm_gb=0.001", f"trainer.default_local_dir={run}"
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "memory plan: phase gen needs" in out.stderr
    assert not run.exists()  # no config written, no torchrun started


def test_the_reward_model_has_its_phase_and_stays_resident_unless_offloaded():
    rm = ["reward_model.enable=true", "reward_model.model.path=~/models/Qwen2.5-7B-RM"]
    _, plan = plan_of("qwen7b_klppo", *rm)
    assert [p.name for p in plan.phases] == [
        "gen",
        "old_log_prob",
        "ref",
        "values",
        "reward_model",
        "update_actor",
        "update_critic",
    ]
    rm_params = 7_615_616_512 - 152064 * 3584 + 3584  # the LM head replaced by a one-label score head
    gen = phase(plan, "gen")
    # kept in its compute dtype (bf16: a frozen model, as verl), sharded over 8 GPUs
    assert gen.parts["reward model params"] == pytest.approx(rm_params * 2 / 8)
    assert "reward_model.model.fsdp_config.param_offload" in gen.shrink
    assert (
        phase(plan, "reward_model").parts["logits"] > 0
        and "reward_model.micro_batch_size_per_gpu" in phase(plan, "reward_model").shrink
    )
    _, offloaded = plan_of("qwen7b_klppo", *rm, "reward_model.model.fsdp_config.param_offload=true")
    assert phase(offloaded, "gen").parts["reward model params"] == 0.0
    assert phase(offloaded, "gen").total == pytest.approx(gen.total - rm_params * 2 / 8)


def test_the_host_line_counts_offloaded_state_and_the_copy_rank0_reads():
    """qwen7b_klppo on 8 GPUs: per rank the runtime, the actor's Adam moments (optimizer_offload)
    and the reference's offloaded shard, both in pinned memory, where each tensor's shard is an
    allocation torch's caching host allocator rounds up to a power of two (counted here from the
    model's own parameters); once per node the fp32 copy rank 0 reads at start-up. Refused before
    anything is queued when launcher.mem_gb is smaller, naming the keys."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlhf_hpc.planning.sizing import KNOWN_MODELS

    cfg, _ = load_config("qwen7b_klppo", ["launcher.mem_gb=480"], check_files=False)
    plan, errors, _ = check_plan(cfg)
    params = plan.shape.params
    host = plan.host
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**KNOWN_MODELS["qwen2.5-7b"]))
    shards = [-(-p.shape[0] // 8) * (p.numel() // p.shape[0]) for p in model.parameters()]  # FSDP2: dim 0

    def pinned(element_bytes: int) -> int:
        return sum(1 << (element_bytes * n - 1).bit_length() for n in shards)

    assert errors == [] and host.ranks == 8 and host.capacity == 480 * GiB
    assert host.per_rank == pytest.approx(
        {"runtime": 3 * GiB, "actor Adam moments": 2 * pinned(4), "ref offloaded": pinned(2)}
    )
    # the rounding: this model's shards on 8 ranks take ~1.9x their bytes
    assert 1.8 < host.per_rank["actor Adam moments"] / (8 * params / 8) < 2
    assert f"actor offload: ~{2 * pinned(4) / GiB:.1f} GiB of host memory per rank" in plan.notes
    assert host.loading == pytest.approx(4 * params)  # one fp32 copy, not one per rank
    assert "# OK   host/node" in plan.render()
    cfg.launcher.mem_gb = 64
    _, errors, _ = check_plan(cfg)
    moments, ref = host.per_rank["actor Adam moments"] / GiB, host.per_rank["ref offloaded"] / GiB
    assert errors == [
        f"memory plan: host memory per node needs {host.total / GiB:.1f} GiB but launcher.mem_gb gives "
        f"64 GiB (8 ranks x {sum(host.per_rank.values()) / GiB:.2f} (runtime 3.00, actor Adam moments {moments:.2f}, "
        f"ref offloaded {ref:.2f}) + loading 28.37 (rank 0 reads the checkpoint)); shrink it with "
        f"launcher.mem_gb (ask Slurm for more), actor_rollout_ref.actor.fsdp_config.optimizer_offload=false, "
        f"actor_rollout_ref.ref.fsdp_config.param_offload=false, "
        f"actor_rollout_ref.actor.fsdp_config.model_dtype=bfloat16 (the copy rank 0 reads), "
        f"trainer.n_gpus_per_node (fewer ranks per node, more nodes)"
    ]


def test_a_tiny_random_model_has_nothing_to_read():
    plan, _, _ = check_plan(load_config("tiny_klppo", [], check_files=False)[0])
    assert plan.host.loading == 0 and plan.host.per_rank == {"largest phase": plan.peak}


def test_a_lora_actors_sleeping_engine_is_in_the_host_line_and_the_time_plan():
    """vLLM sleeps at level 1 for a LoRA actor (the base must survive): each device segment of its
    weights goes to a pinned host buffer at every sleep, rounded up to a power of two, and back at the
    wake (over the host link, in gen and update_weights). At 7B, TP 1, bf16: 14.2 GiB of weights,
    ~27 GiB of pinned buffers. A full model sleeps at level 2: nothing of note is copied."""
    from rlhf_hpc.planning.sizing import GiB, engine_weight_segments
    from rlhf_hpc.planning.time_plan import build_time_plan

    per_rank, times = {}, {}
    for name, recipe, extra in (
        ("tp1", "qwen7b_lora_klppo", []),
        ("tp2", "qwen7b_lora_klppo", ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"]),
        ("full", "qwen7b_klppo", []),
    ):
        cfg, _ = load_config(recipe, extra, check_files=False)
        plan, _, _ = check_plan(cfg)
        per_rank[name], times[name] = plan.host.per_rank, build_time_plan(cfg, memory=plan)
        shape = plan.shape
    # the segments hold every weight once (q/k/v and gate/up fused, 1/TP each), rounded up to 2 MiB at most each
    for tp in (1, 2):
        segments = engine_weight_segments(shape, tp, 2)
        assert 0 <= sum(segments) - shape.params * 2 / tp <= 2 * 2**20 * len(segments)
        # each pinned buffer: the segment rounded up to a power of two (<= 2x)
        pinned = per_rank[f"tp{tp}"]["engine asleep (LoRA)"]
        assert sum(segments) < pinned < 2 * sum(segments)
        sleep = times[f"tp{tp}"].phase("gen").parts["engine sleep (host link)"]
        assert sleep == times[f"tp{tp}"].phase("update_weights").parts["engine wake (host link)"] > 0
    assert 25 < per_rank["tp1"]["engine asleep (LoRA)"] / GiB < 29  # (14.2 GiB of weights)
    assert per_rank["tp2"]["engine asleep (LoRA)"] < 0.6 * per_rank["tp1"]["engine asleep (LoRA)"]
    assert times["tp2"].phase("gen").parts["engine sleep (host link)"] == pytest.approx(
        times["tp1"].phase("gen").parts["engine sleep (host link)"] / 2, rel=0.05
    )
    assert "engine asleep (LoRA)" not in per_rank["full"]  # level 2 discards the weights
    assert "engine sleep (host link)" not in times["full"].phase("gen").parts


def test_a_cpu_vllm_engine_gets_the_kv_cache_its_sequences_need_at_most_1_gib(monkeypatch):
    """The plan's vLLM share on CPU is the engine's: its weights, room for max_num_seqs sequences of
    max_model_len tokens in 32-token blocks (the engine asks vLLM for exactly that), its runtime;
    VLLM_CPU_KVCACHE_SPACE, where set, is the KV cache in GiB."""
    from rlhf_hpc.planning.memory_plan import VLLM_CPU_RUNTIME_GB, cpu_kv_cache_bytes

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert cpu_kv_cache_bytes(16, 40, 1024) == 16 * 64 * 1024  # 40 tokens: two blocks of 32
    assert cpu_kv_cache_bytes(1024, 4096, 46080) == GiB  # SmolLM2-135M's need, past the cap

    key = "vLLM (weights + KV cache + its runtime)"
    cfg, plan = plan_of(
        "tiny_klppo", "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.max_num_seqs=64"
    )
    s = model_shape(cfg.actor_rollout_ref.model.path)
    weights = s.params * 4  # float32
    kv = 64 * 64 * 2 * s.layers * s.kv_heads * s.head_dim * 4  # 64 sequences of 40 tokens (2 blocks)
    assert phase(plan, "gen").parts[key] == pytest.approx(weights + kv + VLLM_CPU_RUNTIME_GB * GiB)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    _, plan = plan_of("tiny_klppo", "actor_rollout_ref.rollout.name=vllm")
    assert phase(plan, "gen").parts[key] == pytest.approx(weights + 2 * GiB + VLLM_CPU_RUNTIME_GB * GiB)
