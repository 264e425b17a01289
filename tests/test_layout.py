"""The FSDP layout chosen for models whose recipe leaves it open (rlhf_hpc/planning/layout.py and
layout_search.py): the fastest shard group by the time plan whose memory plan fits, ties to the
smaller group; explicit keys win; the memory plan and the log say what was chosen and why. That
the engine builds the chosen mesh and trains like one process on it: tests/test_engine_dist.py
(``actor_4x1``) and the demo's log (tests/test_train_e2e.py)."""

from __future__ import annotations

from rlhf_hpc.planning.layout import choose_layouts, describe, resolved_fsdp_configs
from rlhf_hpc.planning.layout_search import TIE_SHARE, candidate_sizes, margined_peak, plan_candidates
from rlhf_hpc.planning.memory_plan import build_plan, check_plan
from rlhf_hpc.planning.sizing import GiB, model_shape
from rlhf_hpc.recipe.load import load_config

# the GPU recipes are planned for a Slurm cluster wherever the test runs: launcher.cluster=auto is
# "local" on a machine without sbatch (this machine's memory, one node)
ON_SLURM = "launcher.cluster=slurm"
OPEN = ["actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.ref.fsdp_config", "critic.model.fsdp_config"]


def assert_fastest_that_fits(cfg) -> int:
    """The chosen size fits, and no fitting candidate is faster by more than the tie share; the
    ones left out are named in the reason."""
    size = choose_layouts(cfg)["actor"].fsdp_size
    candidates, no_time = plan_candidates(cfg, OPEN)
    assert no_time == ""
    chosen = next(c for c in candidates if c.fsdp_size == size)
    assert chosen.problem == ""
    for c in candidates:
        if not c.problem:
            assert chosen.step_s <= c.step_s * (1 + TIE_SHARE), (c, chosen)
            if c.fsdp_size < size:  # a smaller group that fits is left only for a slower step
                assert c.step_s > chosen.step_s
    line = next(line for line in describe(cfg) if line.startswith("FSDP layout of actor"))
    for c in candidates:
        if c.fsdp_size != size:
            assert f"fsdp_size={c.fsdp_size}" + (" does not fit" if c.problem else ":") in line
    return size


def test_a_small_model_is_replicated_and_the_reason_is_given():
    cfg = load_config("tiny_klppo")[0]
    layouts = choose_layouts(cfg)
    assert {(lay.fsdp_size, lay.reshard_after_forward, lay.forward_prefetch) for lay in layouts.values()} == {
        (1, False, False)
    }
    assert assert_fastest_that_fits(cfg) == 1
    line = describe(cfg)[0]
    assert line.startswith("FSDP layout of actor, ref, critic: fsdp_size=1, reshard_after_forward=false")
    assert (
        "replicated on every rank (fsdp_size=1): the fastest layout the time plan finds that fits the memory plan"
        in line
    )
    # the plan is built on the chosen layout and prints the choice
    plan = build_plan(cfg)
    assert line in plan.notes
    update = next(p for p in plan.phases if p.name == "update_actor")
    params = model_shape(cfg.actor_rollout_ref.model.path).params
    assert update.parts["params"] == params * 4  # unsharded: the whole model on each rank


def test_a_7b_model_is_sharded_inside_the_node_and_explicit_keys_win():
    cfg = load_config("qwen7b_klppo", [ON_SLURM], check_files=False)[0]
    fsdp = resolved_fsdp_configs(cfg)
    assert fsdp["actor"].fsdp_size == 8 and fsdp["actor"].reshard_after_forward is True
    assert fsdp["actor"].forward_prefetch is True  # set in the recipe: kept
    assert fsdp["critic"].forward_prefetch is False
    assert assert_fastest_that_fits(cfg) == 8
    line = describe(cfg)[0]
    # 1 and 2 ranks exceed an 80 GiB GPU; 4 would fill it to within the plan's margin
    assert "sharded over 8 ranks (fsdp_size=8)" in line and "of 80 GiB per rank" in line
    assert "fsdp_size=1 does not fit (peak" in line
    assert "fsdp_size=4 does not fit (peak 79.9 GiB, 94.0 with the margin, over 80)" in line
    # explicit values win over the choice, and are not reported as chosen
    tiny = load_config(
        "tiny_klppo",
        ["actor_rollout_ref.actor.fsdp_config.fsdp_size=2", "critic.model.fsdp_config.reshard_after_forward=true"],
    )[0]
    layouts = choose_layouts(tiny)
    assert layouts["actor"].fsdp_size == 2 and layouts["actor"].reshard_after_forward is True
    assert layouts["critic"].fsdp_size == 1 and layouts["critic"].reshard_after_forward is True
    assert (layouts["ref"].fsdp_size, layouts["ref"].reshard_after_forward) == (1, False)
    lines = describe(tiny)
    assert any(
        line.startswith("FSDP layout of actor: fsdp_size=2, reshard_after_forward=true")
        and "fsdp_size=2 as set: parameters freed after the forward (sharded)" in line
        for line in lines
    )
    assert any(line.startswith("FSDP layout of critic: fsdp_size=1, reshard_after_forward=true") for line in lines)


def test_the_choice_follows_the_memory_a_rank_has():
    big = load_config("tiny_klppo", ["trainer.device=cuda", "hardware.hbm_gb=80"])[0]
    assert choose_layouts(big)["actor"].fsdp_size == 1
    model = "actor_rollout_ref.model.path=tiny://qwen2?vocab_size=64&hidden_size=1024&num_hidden_layers=8"
    cfg = load_config("tiny_klppo", ["trainer.device=cuda", "hardware.hbm_gb=4", model])[0]
    # ~100M parameters with a critic and a reference: a 4 GiB GPU holds them sharded, not replicated
    assert assert_fastest_that_fits(cfg) == cfg.trainer.n_gpus_per_node == 2
    assert "fsdp_size=1 does not fit" in describe(cfg)[0]


def test_32b_and_70b_on_64_gpus_get_a_layout_that_fits():
    """The layout chooser of a fixed share picked fsdp_size=8 (a node) for these, which fails the
    memory plan; the plans' chooser shards over nodes."""
    for model, tp, size in (("Qwen/Qwen2.5-32B-Instruct", 4, 32), ("meta-llama/Llama-3.1-70B-Instruct", 8, 64)):
        cfg = load_config(
            "llama8b_grpo",
            [
                ON_SLURM,
                f"actor_rollout_ref.model.path={model}",
                "trainer.nnodes=8",
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
                "actor_rollout_ref.model.enable_gradient_checkpointing=true",
            ],
            check_files=False,
        )[0]
        assert candidate_sizes(64, 8) == [1, 2, 4, 8, 16, 32, 64]
        assert assert_fastest_that_fits(cfg) == size, model
        plan, errors, _ = check_plan(cfg)
        assert errors == [] and margined_peak(plan) <= plan.capacity / GiB
        assert "fsdp_size=8 does not fit" in describe(cfg)[0]
    # nothing fits (no activation checkpointing): the smallest peak, and the memory plan says what to shrink
    cfg = load_config(
        "llama8b_grpo",
        [ON_SLURM, "actor_rollout_ref.model.path=meta-llama/Llama-3.1-70B-Instruct", "trainer.nnodes=8"],
        check_files=False,
    )[0]
    assert choose_layouts(cfg)["actor"].fsdp_size == 64
    assert "no layout fits the memory plan; the smallest peak" in describe(cfg)[0]
    assert "enable_gradient_checkpointing" in check_plan(cfg)[1][0]


def test_a_model_of_unknown_size_is_sharded_inside_a_node():
    cfg = load_config("qwen7b_klppo", ["actor_rollout_ref.model.path=/nowhere/some-model"], check_files=False)[0]
    layout = choose_layouts(cfg)["actor"]
    assert layout.fsdp_size == 8 and "the model's size is unknown here" in layout.reason


def test_activation_checkpointing_is_chosen_from_the_micro_batch_activations():
    from rlhf_hpc.planning.layout import choose_checkpointing

    tiny = load_config("tiny_klppo")[0]  # the recipe turns the actor's off; the critic's is left open
    choice = choose_checkpointing(tiny)
    assert choice["actor"] == (False, "")
    assert choice["critic"][0] is False and "fit in 10% of" in choice["critic"][1]
    assert any(line.startswith("activation checkpointing of the critic: off") for line in describe(tiny))
    update = next(p for p in build_plan(tiny).phases if p.name == "update_critic")
    assert "gradient checkpointing" not in update.note
    # a token budget whose activations would not fit a small GPU turns it on
    big = load_config(
        "tiny_klppo",
        [
            "trainer.device=cuda",
            "hardware.hbm_gb=1",
            "critic.use_dynamic_bsz=true",
            "critic.ppo_max_token_len_per_gpu=65536",
        ],
    )[0]
    on, why = choose_checkpointing(big)["critic"]
    assert on and "exceed 10% of 1 GiB per rank: on" in why
    # set in the recipe: kept, and not reported as chosen
    seven = load_config("qwen7b_klppo", check_files=False)[0]
    assert choose_checkpointing(seven) == {"actor": (True, ""), "critic": (True, "")}
