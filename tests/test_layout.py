"""The FSDP layout chosen for models whose recipe leaves it open (rlhf_hpc/planning/layout.py): replicated
when the whole training state is small against a rank's memory, sharded inside a node otherwise;
explicit keys win; the memory plan and the log say what was chosen and why. That the engine
builds the chosen mesh and trains like one process on it: tests/test_engine_dist.py
(``actor_4x1``) and the demo's log (tests/test_train_e2e.py)."""
from __future__ import annotations

from rlhf_hpc.planning.layout import choose_layouts, describe, resolved_fsdp_configs, training_state_bytes
from rlhf_hpc.planning.memory_plan import build_plan
from rlhf_hpc.planning.sizing import GiB, model_shape
from rlhf_hpc.recipe.load import load_config


def test_a_small_model_is_replicated_and_the_reason_is_given():
    cfg = load_config("tiny_klppo")[0]
    layouts = choose_layouts(cfg)
    assert {(lay.fsdp_size, lay.reshard_after_forward, lay.forward_prefetch) for lay in layouts.values()} == {(1, False, False)}
    line = describe(cfg)[0]
    assert line.startswith("FSDP layout of actor, ref, critic: fsdp_size=1, reshard_after_forward=false")
    assert "fits in 20% of" in line and "replicated on every rank" in line
    # the plan is built on the chosen layout and prints the choice
    plan = build_plan(cfg)
    assert line in plan.notes
    update = next(p for p in plan.phases if p.name == "update_actor")
    params = model_shape(cfg.actor_rollout_ref.model.path).params
    assert update.parts["params"] == params * 4  # unsharded: the whole model on each rank


def test_a_7b_model_is_sharded_inside_the_node_and_explicit_keys_win():
    cfg = load_config("qwen7b_klppo", check_files=False)[0]
    fsdp = resolved_fsdp_configs(cfg)
    assert fsdp["actor"].fsdp_size == 8 and fsdp["actor"].reshard_after_forward is True
    assert fsdp["actor"].forward_prefetch is True  # set in the recipe: kept
    assert fsdp["critic"].forward_prefetch is False
    state = training_state_bytes(cfg, 7_615_616_512)
    assert state > 0.2 * 80 * GiB
    assert any("needs more than 20% of 80 GiB per rank: sharded inside a node (fsdp_size=8)" in line
               for line in describe(cfg))
    # explicit values win over the choice, and are not reported as chosen
    tiny = load_config("tiny_klppo", ["actor_rollout_ref.actor.fsdp_config.fsdp_size=2",
                                      "critic.model.fsdp_config.reshard_after_forward=true"])[0]
    layouts = choose_layouts(tiny)
    assert layouts["actor"].fsdp_size == 2 and layouts["actor"].reshard_after_forward is True
    assert layouts["critic"].fsdp_size == 1 and layouts["critic"].reshard_after_forward is True
    assert (layouts["ref"].fsdp_size, layouts["ref"].reshard_after_forward) == (1, False)
    lines = describe(tiny)
    assert any(line.startswith("FSDP layout of actor: fsdp_size=2, reshard_after_forward=true")
               and "fsdp_size=2 as set: parameters freed after the forward (sharded)" in line for line in lines)
    assert any(line.startswith("FSDP layout of critic: fsdp_size=1, reshard_after_forward=true") for line in lines)


def test_the_choice_follows_the_memory_a_rank_has():
    small_gpu = ["trainer.device=cuda", "hardware.hbm_gb=1"]
    big = load_config("tiny_klppo", ["trainer.device=cuda", "hardware.hbm_gb=80"])[0]
    assert choose_layouts(big)["actor"].fsdp_size == 1
    model = "actor_rollout_ref.model.path=tiny://qwen2?vocab_size=64&hidden_size=1024&num_hidden_layers=8"
    cfg = load_config("tiny_klppo", [*small_gpu, model])[0]
    state = training_state_bytes(cfg, model_shape(cfg.actor_rollout_ref.model.path).params)
    assert state > 0.2 * GiB  # ~100M parameters: over a fifth of 1 GiB
    assert choose_layouts(cfg)["actor"].fsdp_size == cfg.trainer.n_gpus_per_node


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
    big = load_config("tiny_klppo", ["trainer.device=cuda", "hardware.hbm_gb=1", "critic.use_dynamic_bsz=true",
                                     "critic.ppo_max_token_len_per_gpu=65536"])[0]
    on, why = choose_checkpointing(big)["critic"]
    assert on and "exceed 10% of 1 GiB per rank: on" in why
    # set in the recipe: kept, and not reported as chosen
    seven = load_config("qwen7b_klppo", check_files=False)[0]
    assert choose_checkpointing(seven) == {"actor": (True, ""), "critic": (True, "")}
