"""A verl user's recipe behaves here as in verl: command lines, key defaults, refused features,
data checked before the launch, chat templates, and a 4-rank run of a step whose prompts do not
divide over the ranks (every prompt trained, critic warm-up, chunked validation)."""

from __future__ import annotations

import shlex
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from rlhf_hpc.cli import main as cli_main
from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.tree import to_dict
from rlhf_hpc.observability.tracking import read_metrics
from rlhf_hpc.recipe.load import load_config
from tests.conftest import launch_here, run_launch

# Command lines written the way verl's examples/ppo_trainer and examples/grpo_trainer scripts are
# (FSDP + vLLM, GSM8K), with `python3 -m verl.trainer.main_ppo` replaced by `launch.py`.
VERL_PPO = """
    algorithm.adv_estimator=gae data.train_files=$HOME/data/gsm8k/train.parquet
    data.val_files=$HOME/data/gsm8k/test.parquet data.train_batch_size=1024 data.max_prompt_length=512
    data.max_response_length=512 data.filter_overlong_prompts=True data.truncation='error'
    actor_rollout_ref.model.path=deepseek-ai/deepseek-llm-7b-chat actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32
    actor_rollout_ref.rollout.tensor_model_parallel_size=4 actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4 critic.optim.lr=1e-5 critic.model.use_remove_padding=True
    critic.model.path=deepseek-ai/deepseek-llm-7b-chat critic.model.enable_gradient_checkpointing=True
    critic.ppo_micro_batch_size_per_gpu=32 critic.model.fsdp_config.param_offload=False
    critic.model.fsdp_config.optimizer_offload=False algorithm.use_kl_in_reward=False trainer.critic_warmup=0
    trainer.logger='["console","wandb"]' trainer.project_name='verl_example_gsm8k'
    trainer.experiment_name='deepseek_llm_7b_function_rm' trainer.n_gpus_per_node=8 trainer.nnodes=1
    trainer.save_freq=20 trainer.test_freq=1 trainer.use_legacy_worker_impl=auto trainer.total_epochs=15
"""
VERL_GRPO = """
    algorithm.adv_estimator=grpo data.train_files=$HOME/data/gsm8k/train.parquet
    data.val_files=$HOME/data/gsm8k/test.parquet data.train_batch_size=1024 data.max_prompt_length=512
    data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation='error'
    actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 actor_rollout_ref.ref.fsdp_config.param_offload=True
    algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger=console
    trainer.project_name='verl_grpo_example_gsm8k' trainer.experiment_name='qwen2_7b_function_rm'
    trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15
"""
# the same, with verl's token-budget ("seq balance") and its rollout mode set to synchronous
VERL_GRPO_SEQ_BALANCE = VERL_GRPO.replace(
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
    """
    actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000
    actor_rollout_ref.rollout.mode=sync data.return_raw_chat=False""",
)


def verl_args(text: str, home: str) -> list[str]:
    return shlex.split(textwrap.dedent(text).replace("$HOME", home))


@pytest.mark.parametrize(
    "script", [VERL_PPO, VERL_GRPO, VERL_GRPO_SEQ_BALANCE], ids=["ppo", "grpo", "grpo_seq_balance"]
)
def test_verl_example_command_lines_dry_run_unchanged(script, tmp_path):
    out = launch_here(*verl_args(script, str(tmp_path)), "cluster=local", "--dry-run")
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout.partition("# command (cluster=local)\n")[0])
    assert cfg["trainer"]["recipe"] is None  # no recipe: verl's defaults are the base
    assert isinstance(cfg["trainer"]["logger"], list)
    # keys verl interpolates from the actor arrive the same way here
    actor = cfg["actor_rollout_ref"]["actor"]
    assert cfg["actor_rollout_ref"]["rollout"]["log_prob_use_dynamic_bsz"] == actor["use_dynamic_bsz"]
    assert cfg["critic"]["ppo_mini_batch_size"] == actor["ppo_mini_batch_size"]


def dry_run(args: list[str], capsys) -> tuple[int, str]:
    """``python launch.py ARGS --dry-run`` in this process (what launch.py calls): (exit code, stderr)."""
    capsys.readouterr()
    rc = cli_main([*args, "--dry-run"])
    return rc, capsys.readouterr().err


# every line of verl b178a3c's examples/*/run_*.sh (FSDP, main_ppo) that refuses a feature not here: the
# refusal names the feature, never an unknown key or a type
@pytest.mark.parametrize(
    "extra,feature",
    [
        ("actor_rollout_ref.rollout.mode=server", "asynchronous rollout"),
        ("actor_rollout_ref.rollout.over_sample_rate=0.1", "over-sampling in the asynchronous rollout"),
        ("reward_model.use_reward_loop=True", "the reward loop"),
        ("reward_model.rollout.name=vllm", "the reward loop"),
        ("reward_model.num_workers=8", "the reward loop"),
        ("actor_rollout_ref.model.use_fused_kernels=True", "fused log-prob kernels"),
        ("+reward_model.reward_kwargs.format_score=0.1", "other keyword arguments of the reward manager"),
        ("trainer.use_legacy_worker_impl=disable", "worker implementations"),
        ("reward_model.enable_resource_pool=True", "a separate resource pool for the reward model"),
        ("reward_model.launch_reward_fn_async=True", "asynchronous reward functions"),
        ("reward_model.micro_batch_size=8", "use reward_model.micro_batch_size_per_gpu"),
        ("actor_rollout_ref.rollout.trace.token2text=True", "rollout tracing"),
        ("actor_rollout_ref.rollout.trace.backend=mlflow", "rollout tracing"),
        ("actor_rollout_ref.ref.use_torch_compile=True", "torch.compile"),
        ("actor_rollout_ref.model.enable_activation_offload=True", "activation offloading"),
        ("actor_rollout_ref.actor.use_prefix_grouper=True", "the prefix grouper"),
        ("actor_rollout_ref.actor.profiler.enable=True", "per-worker profiler settings"),
        ("actor_rollout_ref.ref.profiler.tool_config.npu.level=level0", "per-worker profiler settings"),
        ("global_profiler.profile_continuous_steps=True", "one profile over consecutive steps"),
        ("+actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache=True", "multi-modal"),
        ("actor_rollout_ref.actor.freeze_vision_tower=True", "multi-modal"),
        ("data.custom_cls.path=recipe/my_recipe/dataset.py", "custom dataset classes"),
        ("data.sampler.class_name=RandomCurriculumSampler", "custom data samplers"),
        ("actor_rollout_ref.rollout.data_parallel_size=2", "data parallelism inside the rollout engine"),
        ("trainer.max_actor_ckpt_to_keep=1", "use trainer.max_ckpt_to_keep"),
        ("trainer.resume_from_path=checkpoints/", "use trainer.resume_mode"),
        ("trainer.device=npu", "Ascend NPUs"),
        ("reward_model.reward_manager=prime", "the prime reward manager"),
        ("actor_rollout_ref.actor.router_replay.record_file=/tmp/routes", "routing decisions recorded to or replayed"),
    ],
)
def test_out_of_scope_verl_features_are_refused_by_name(extra, feature, tmp_path, capsys):
    rc, err = dry_run([*verl_args(VERL_GRPO, str(tmp_path)), extra, "cluster=local"], capsys)
    assert rc == 2
    assert feature in err and "is not available in rlhf-hpc" in err, err
    assert "unknown key" not in err and "expected" not in err and "Traceback" not in err


def test_hydra_plus_keys_add_or_override_a_key(tmp_path):
    base = verl_args(VERL_GRPO, str(tmp_path))
    cfg, _ = load_config(
        None,
        base
        + [
            "+actor_rollout_ref.actor.kl_loss_coef=0.01",
            "++actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
            "+data.apply_chat_template_kwargs.enable_thinking=False",
        ],
        check_files=False,
    )
    arr = cfg.actor_rollout_ref
    assert (arr.actor.kl_loss_coef, arr.rollout.val_kwargs.temperature) == (0.01, 0.6)
    assert cfg.data.apply_chat_template_kwargs == {"enable_thinking": False}
    # an unknown key stays one, named without the plus
    with pytest.raises(ConfigError) as e:
        load_config(None, base + ["+actor_rollout_ref.actor.no_such_key=1"], check_files=False)
    assert e.value.errors == ["unknown key 'actor_rollout_ref.actor.no_such_key' in section 'actor_rollout_ref.actor'"]
    with pytest.raises(ConfigError, match="is not of the form key.path=value"):
        load_config(None, ["+++data.train_batch_size=8"], check_files=False)


# verl values accepted and dropped: verl's defaults of features not here, and values asking for what
# happens here anyway (the engine's log-probs, LoRA's weight loading, single-turn async generation)
VERL_VALUES_ACCEPTED = [
    "actor_rollout_ref.actor.checkpoint.async_save=False",
    "actor_rollout_ref.actor.entropy_checkpointing=False",
    "actor_rollout_ref.ref.entropy_checkpointing=False",
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking=False",
    # what the entropy always gets here (verl's GSPO 3B line sets entropy_checkpointing=true)
    "actor_rollout_ref.actor.entropy_checkpointing=True",
    "actor_rollout_ref.ref.entropy_from_logits_with_chunking=True",
    "actor_rollout_ref.rollout.trace.token2text=False",
    "actor_rollout_ref.rollout.trace.backend=null",
    "actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker=null",
    "actor_rollout_ref.rollout.calculate_log_probs=True",
    "actor_rollout_ref.rollout.load_format=safetensors",
    "actor_rollout_ref.rollout.layered_summon=True",
    "actor_rollout_ref.rollout.multi_stage_wake_up=True",
    "actor_rollout_ref.actor.fsdp_config.use_orig_params=True",
    "actor_rollout_ref.rollout.over_sample_rate=0",
    "actor_rollout_ref.rollout.multi_turn.enable=False",
    "actor_rollout_ref.rollout.multi_turn.format=hermes",
    "data.return_raw_chat=True",
    "data.image_key=images",
    "data.custom_cls.path=null",
    "global_profiler.global_tool_config.torch_memory.stack_depth=32",
    "algorithm.filter_groups.enable=False",
]


def test_verl_off_values_are_accepted_and_dropped(tmp_path):
    base = verl_args(VERL_GRPO, str(tmp_path))
    plain, _ = load_config(None, base, check_files=False)
    cfg, warnings = load_config(
        None, base + VERL_VALUES_ACCEPTED + ["actor_rollout_ref.rollout.calculate_log_probs=False"], check_files=False
    )
    assert yaml.safe_dump(to_dict(cfg)) == yaml.safe_dump(to_dict(plain))  # nothing changed
    assert warnings == load_config(None, base, check_files=False)[1]  # and nothing said


def test_verls_deprecated_global_micro_batch_sizes_are_divided_as_verl_does(tmp_path):
    base = [a for a in verl_args(VERL_GRPO, str(tmp_path)) if "micro_batch_size_per_gpu" not in a]
    cfg, warnings = load_config(
        None,
        base
        + [
            "actor_rollout_ref.actor.ppo_micro_batch_size=64",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size=128",
            "actor_rollout_ref.ref.log_prob_micro_batch_size=null",
        ],
        check_files=False,
    )
    arr = cfg.actor_rollout_ref  # 8 ranks
    assert (arr.actor.ppo_micro_batch_size_per_gpu, arr.rollout.log_prob_micro_batch_size_per_gpu) == (8, 16)
    assert (
        "actor_rollout_ref.actor.ppo_micro_batch_size=64 (verl's deprecated global size): "
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8, as verl divides it over 8 data-parallel ranks"
        in warnings
    )
    with pytest.raises(ConfigError, match=r"set one of them \(verl refuses both as well\)"):
        load_config(
            None,
            base
            + [
                "actor_rollout_ref.actor.ppo_micro_batch_size=64",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            ],
            check_files=False,
        )
    with pytest.raises(ConfigError, match=r"divided by the data-parallel ranks \(8\), which must leave at least 1"):
        load_config(None, base + ["critic.ppo_micro_batch_size=4"], check_files=False)


def test_async_rollout_on_a_single_turn_run_says_where_generation_runs(tmp_path, capsys):
    base = [*verl_args(VERL_GRPO, str(tmp_path)), "cluster=local"]
    rc, err = dry_run(base + ["actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=True"], capsys)
    assert rc == 0, err
    assert [line for line in err.splitlines() if "rollout.mode" in line] == [
        "warning: actor_rollout_ref.rollout.mode=async: generation runs in the engines of this job's ranks, no "
        "rollout server: in every trainer rank (colocated), or in the rollout ranks with "
        "actor_rollout_ref.hybrid_engine=false; with multi_turn.enable it is the agent loop there, turn by turn, "
        "tools run between turns"
    ]
    rc, err = dry_run(
        base + ["actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.multi_turn.enable=True"], capsys
    )
    assert rc == 0, err  # (tests/test_multi_turn.py: verl's multi-turn command lines)


def test_raw_chat_for_a_reward_model_re_encodes_with_its_template(tmp_path):
    """verl's reward-model scripts set data.return_raw_chat=True so that the reward model re-encodes the
    conversation with its own chat template: here that fills reward_model.model.input_tokenizer with
    the actor's tokenizer (said once); a value the user set stays; without a reward model it changes nothing."""
    base = verl_args(VERL_GRPO, str(tmp_path)) + ["data.return_raw_chat=True"]
    rm = ["reward_model.enable=True", "reward_model.model.path=tiny://qwen2"]
    cfg, warnings = load_config(None, base + rm, check_files=False)
    assert cfg.reward_model.model.input_tokenizer == cfg.actor_rollout_ref.model.path
    assert any("re-encoded with the reward model's chat template" in w for w in warnings), warnings
    mine = "reward_model.model.input_tokenizer=" + cfg.actor_rollout_ref.model.path
    assert (
        load_config(None, base + rm + [mine], check_files=False)[0].reward_model.model.input_tokenizer
        == cfg.actor_rollout_ref.model.path
    )
    assert load_config(None, base, check_files=False)[0].reward_model.model.input_tokenizer is None


@pytest.mark.parametrize(
    "override,message",
    [
        ("data.dataloader_num_workers=8", "data.dataloader_num_workers=8: there is no data loader pool here"),
        # (the split layout without rollout ranks: tests/test_split_layout.py)
        ("actor_rollout_ref.hybrid_engine=false", "the split layout needs rollout ranks"),
        ("data.reward_fn_key=ability", "data.reward_fn_key='ability': rewards are chosen by the data_source column"),
        ("actor_rollout_ref.actor.fsdp_config.mixed_precision.buffer_dtype=bf16", "buffer_dtype: FSDP2 keeps buffers"),
        # a disabled reward model's keys would have no effect (tests/test_reward_model.py checks the enabled ones)
        (
            "reward_model.micro_batch_size_per_gpu=4",
            "reward_model.micro_batch_size_per_gpu is set but reward_model.enable=false",
        ),
        ("reward_model.max_length=512", "reward_model.max_length is set but reward_model.enable=false"),
        ("reward_model.strategy=fsdp", "reward_model.strategy is set but reward_model.enable=false"),
        (
            "reward_model.model.input_tokenizer=Qwen/Qwen2-7B-Instruct",
            "reward_model.model.input_tokenizer is set but reward_model.enable=false",
        ),
        ("actor_rollout_ref.model.custom_chat_template='{% for m in messages %}'", "not a valid Jinja template"),
        ("actor_rollout_ref.model.external_lib=no_such_module_here", "no such Python module here"),
        # inference-only models reduce no gradients and have no optimizer
        (
            "actor_rollout_ref.ref.fsdp_config.mixed_precision.reduce_dtype=bf16",
            "actor_rollout_ref.ref.fsdp_config.mixed_precision.reduce_dtype=bf16: this model only runs forward passes",
        ),
        ("actor_rollout_ref.ref.fsdp_config.optimizer_offload=true", "the reference model has no optimizer"),
    ],
)
def test_keys_without_an_effect_here_refuse_non_default_values(override, message):
    with pytest.raises(ConfigError) as e:
        load_config("tiny_klppo", [override])
    assert any(message in line for line in e.value.errors), e.value.errors


def test_strategy_fsdp_says_that_fsdp2_runs():
    _, warnings = load_config("tiny_klppo", ["actor_rollout_ref.actor.strategy=fsdp", "critic.strategy=fsdp"])
    assert [w for w in warnings if "strategy" in w] == [
        "actor_rollout_ref.actor.strategy=fsdp, critic.strategy=fsdp: the engine here is FSDP2 (fully_shard) whatever "
        "the strategy; verl's fsdp would be FSDP1. Set fsdp2 to say what runs"
    ]
    assert not [w for w in load_config("tiny_klppo")[1] if "strategy" in w]


def test_keys_verl_takes_from_the_actor_default_to_the_actor():
    cfg, _ = load_config(
        "tiny_klppo",
        [
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
            "actor_rollout_ref.actor.shuffle=true",
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
            "critic.ppo_max_token_len_per_gpu=8192",
            "actor_rollout_ref.actor.optim.warmup_style=cosine",
        ],
    )
    c, arr = cfg.critic, cfg.actor_rollout_ref
    assert (c.loss_agg_mode, c.shuffle, c.use_dynamic_bsz) == ("seq-mean-token-mean", True, True)
    assert c.forward_max_token_len_per_gpu == 8192
    assert arr.rollout.log_prob_use_dynamic_bsz and arr.ref.log_prob_use_dynamic_bsz
    assert arr.rollout.log_prob_max_token_len_per_gpu == arr.ref.log_prob_max_token_len_per_gpu == 4096
    assert arr.actor.optim.lr_scheduler_type == "cosine"  # verl's deprecated name still works
    # set explicitly, the critic keeps its own
    cfg, _ = load_config(
        "tiny_klppo",
        [
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
            "critic.loss_agg_mode=token-mean",
            "critic.shuffle=false",
        ],
    )
    assert cfg.critic.loss_agg_mode == "token-mean" and cfg.critic.shuffle is False


def test_batch_sizes_verl_accepts_are_accepted():
    # 12 prompts x 2 on 8 ranks (verl accepts it): every rank gets 3 responses
    cfg, warnings = load_config(
        "tiny_klppo",
        [
            "trainer.n_gpus_per_node=8",
            "data.train_batch_size=12",
            "actor_rollout_ref.actor.ppo_mini_batch_size=12",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
        ],
    )
    assert cfg.data.train_batch_size == 12
    # 4 prompts x 4 on 8 ranks: 2 each
    load_config(
        "tiny_klppo",
        [
            "trainer.n_gpus_per_node=8",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        ],
    )
    # a mini-batch that does not divide the step: verl runs a smaller last one; said as a warning
    _, warnings = load_config(
        "tiny_klppo", ["data.train_batch_size=12", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
    )
    assert any("the last mini-batch of each epoch is smaller" in w for w in warnings)
    with pytest.raises(
        ConfigError,
        match=r"data.train_batch_size \(6\) x actor_rollout_ref.rollout.n \(1\) = 6 "
        r"responses must be divisible by the number of ranks",
    ):
        load_config(
            "tiny_klppo",
            [
                "trainer.n_gpus_per_node=4",
                "data.train_batch_size=6",
                "actor_rollout_ref.rollout.n=1",
                "actor_rollout_ref.actor.ppo_mini_batch_size=6",
            ],
        )
    with pytest.raises(ConfigError, match=r"must be at least the number of ranks \(8\)"):
        load_config(
            "tiny_klppo",
            [
                "trainer.n_gpus_per_node=8",
                "data.train_batch_size=16",
                "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                "actor_rollout_ref.rollout.n=2",
            ],
        )


# ------------------------------------------------------------------- data checked before launch
def bad_parquet(path, n=7473):
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"q{i}"}],
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"index": i},
        }
        for i in range(n)
    ]
    rows[n // 2]["reward_model"] = None
    pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.mark.slow
def test_bad_row_is_reported_in_one_line_before_anything_starts(tmp_path):
    bad_parquet(tmp_path / "train.parquet")
    out = run_launch(
        "recipe=tiny_klppo", f"data.train_files={tmp_path}/train.parquet", f"trainer.default_local_dir={tmp_path}/run"
    )
    assert out.returncode == 2
    assert out.stderr.strip() == f"error: bad data: {tmp_path}/train.parquet, row 3736, column 'reward_model': missing"
    assert out.stdout == "" and not (tmp_path / "run").exists()  # nothing started, nothing written


def test_data_check_takes_well_under_a_second_for_gsm8k_size(tmp_path):
    """In this process's CPU seconds, which another worker's load leaves as they are (measured: 0.36
    on the first call, pyarrow's first read included; 0.37 with both cores busy beside it, where the
    wall time was 0.52), so the test needs no `exclusive` wait."""
    import time

    from rlhf_hpc.data.dataset import DataError, check_data_files

    bad_parquet(tmp_path / "train.parquet")
    cfg, _ = load_config("tiny_klppo", [f"data.train_files={tmp_path}/train.parquet"])
    t0 = time.process_time()
    with pytest.raises(DataError):
        check_data_files(cfg.data)
    assert time.process_time() - t0 < 1.0


# ---------------------------------------------------------------------------------- chat template
def test_custom_chat_template_and_template_kwargs_shape_the_prompts():
    from rlhf_hpc.config.schema import DataConfig
    from rlhf_hpc.data.dataset import chat_token_ids
    from rlhf_hpc.models.tokenizer import load_tokenizer

    msgs = [{"role": "user", "content": "abc"}]
    plain = load_tokenizer("tiny://chars")
    custom = load_tokenizer("tiny://chars", chat_template="q: {{ messages[0]['content'] }}{% if loud %}!{% endif %}.")
    assert plain.decode(chat_token_ids(plain, msgs)) == "<|im_start|>user\nabc<|im_end|>\n<|im_start|>assistant\n"
    assert custom.decode(chat_token_ids(custom, msgs)) == "q: abc."
    assert custom.decode(chat_token_ids(custom, msgs, {"loud": True})) == "q: abc!."
    assert DataConfig().apply_chat_template_kwargs == {}


def test_external_lib_is_imported_before_models_are_built(tmp_path, monkeypatch):
    (tmp_path / "my_models_lib.py").write_text("REGISTERED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from rlhf_hpc.models.hf import import_external_libs

    assert import_external_libs("my_models_lib", None, "my_models_lib") == ["my_models_lib"]
    import sys

    assert sys.modules["my_models_lib"].REGISTERED
    cfg, _ = load_config("tiny_klppo", ["actor_rollout_ref.model.external_lib=my_models_lib"])
    assert cfg.critic.model.external_lib == "my_models_lib"  # verl's interpolation


# ----------------------------------------------- 4 ranks, 6 prompts x 2: the step is not divisible
FOUR_RANKS = [
    "recipe=tiny_klppo",
    "actor_rollout_ref.rollout.name=hf",
    "trainer.n_gpus_per_node=4",
    "data.train_batch_size=6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=6",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
    "trainer.total_training_steps=3",
    "trainer.critic_warmup=2",
    "trainer.save_freq=-1",
    "trainer.test_freq=3",
    "data.val_files=synthetic://copy?size=10",
]


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory):
    """The 4-rank run (validation in one batch), and its step-3 checkpoint validated again in
    batches of 3 by an evaluation run (``trainer.val_only``): validation follows step 3's update, so
    only the validation itself can differ."""
    whole = tmp_path_factory.mktemp("whole") / "run"
    out = run_launch(*FOUR_RANKS, "trainer.save_freq=3", f"trainer.default_local_dir={whole}", timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    chunked = tmp_path_factory.mktemp("chunked") / "run"
    out = run_launch(
        *FOUR_RANKS,
        "data.val_batch_size=3",
        "trainer.val_only=true",
        f"trainer.resume_mode={whole / 'global_step_3'}",
        f"trainer.default_local_dir={chunked}",
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return {"whole": read_metrics(whole), "chunked": read_metrics(chunked)}


@pytest.mark.slow
def test_four_ranks_train_on_every_prompt_of_a_step_that_does_not_divide(four_rank_runs):
    records = four_rank_runs["whole"]
    assert [r["training/global_step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["training/prompts_trained"] == 6 and r["training/responses_trained"] == 12
        assert 1.0 <= r["perf/balance_ratio"] <= r["perf/balance_ratio_unbalanced"] + 1e-9


@pytest.mark.slow
def test_critic_warmup_holds_the_actor_back_as_verl_does(four_rank_runs):
    # verl updates the actor once trainer.critic_warmup <= step (steps count from 1)
    updated = ["actor/pg_loss" in r for r in four_rank_runs["whole"]]
    assert updated == [False, True, True]
    assert all("critic/vf_loss" in r for r in four_rank_runs["whole"])


@pytest.mark.slow
def test_validation_scores_the_whole_set_whatever_val_batch_size(four_rank_runs):
    key = "val-core/synthetic/copy/reward/mean@1"
    whole, chunked = four_rank_runs["whole"][-1], four_rank_runs["chunked"]
    assert len(chunked) == 1 and chunked[0]["training/global_step"] == 3  # (the evaluation run's one row)
    assert key in whole and whole[key] == pytest.approx(chunked[0][key], abs=1e-6)


# ------------------------------------------------------- verl's own example scripts, as they are
# verl b178a3c's example command lines that dry-run here as they are (tests/golden/verl_examples.yaml)
VERL_EXAMPLES = yaml.safe_load((Path(__file__).parent / "golden" / "verl_examples.yaml").read_text())


@pytest.mark.parametrize("name", sorted(VERL_EXAMPLES))
def test_verl_example_scripts_dry_run_as_they_are(name, tmp_path, capsys):
    args = verl_args(VERL_EXAMPLES[name], str(tmp_path))
    rc, err = dry_run(args if any(a.startswith("cluster=") for a in args) else [*args, "cluster=local"], capsys)
    assert rc == 0, err


# verl's Qwen3-30B-A3B GSPO expert-parallel line (b178a3c examples/gspo_trainer/test_gspo_qwen30b_a3b_ep.sh,
# its variables substituted): the Megatron backend's keys are refused by name, each with what does its
# job under FSDP2 here, never as unknown keys
VERL_GSPO_30B_EP = """
    --config-path=config --config-name=ppo_megatron_trainer.yaml
    data.train_files=$HOME/data/dapo-math-17k.parquet data.val_files=['$HOME/data/aime-2024.parquet']
    data.prompt_key=prompt data.return_raw_chat=True data.truncation=left data.max_prompt_length=2048
    data.max_response_length=8192 data.train_batch_size=256 actor_rollout_ref.rollout.n=16
    actor_rollout_ref.actor.policy_loss.loss_mode=gspo algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False
    algorithm.kl_ctrl.kl_coef=0.0 actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.kl_loss_coef=0.0
    actor_rollout_ref.actor.clip_ratio_low=3e-4 actor_rollout_ref.actor.clip_ratio_high=4e-4
    actor_rollout_ref.actor.clip_ratio_c=10.0 actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=10240 actor_rollout_ref.model.path=Qwen/Qwen3-30B-A3B-Base
    actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=32
    actor_rollout_ref.actor.optim.clip_grad=1.0 actor_rollout_ref.actor.loss_agg_mode=token-mean
    actor_rollout_ref.actor.megatron.param_offload=True actor_rollout_ref.actor.megatron.optimizer_offload=True
    actor_rollout_ref.actor.megatron.grad_offload=True actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4
    actor_rollout_ref.actor.megatron.expert_model_parallel_size=4
    actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1
    actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=1
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size=4
    actor_rollout_ref.ref.megatron.expert_model_parallel_size=4 actor_rollout_ref.ref.megatron.param_offload=True
    actor_rollout_ref.actor.megatron.use_mbridge=True
    +actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_dtype=fp32
    +actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.tensor_model_parallel_size=1
    trainer.n_gpus_per_node=8 trainer.nnodes=2
"""


def test_verls_megatron_keys_are_refused_by_name_with_their_fsdp2_equivalents(tmp_path, capsys):
    rc, err = dry_run([*verl_args(VERL_GSPO_30B_EP, str(tmp_path)), "cluster=local"], capsys)
    assert rc == 2 and "unknown key" not in err and "Traceback" not in err, err
    megatron = [line for line in err.splitlines() if ".megatron." in line]
    assert len(megatron) == 14, err  # every megatron.* key of the line, one line each
    # --config-name=ppo_megatron_trainer.yaml is verl's Megatron strategy
    assert "actor_rollout_ref.actor.strategy='megatron': the Megatron backend" in err
    assert all("the Megatron backend" in line and "is not available in rlhf-hpc" in line for line in megatron), err
    assert (
        "actor_rollout_ref.actor.megatron.param_offload=True: the Megatron backend (FSDP2 trains here; "
        "actor_rollout_ref.actor.fsdp_config.param_offload)"
    ) in err
    assert (
        "expert_model_parallel_size=4: the Megatron backend (FSDP2 trains here; FSDP2 shards every weight, "
        "experts included, over actor_rollout_ref.actor.fsdp_config.fsdp_size ranks" in err
    )
    assert (
        "actor_rollout_ref.actor.optim.clip_grad=1.0: Megatron's optimizer key clip_grad (FSDP2 trains here; its "
        "gradient clip is actor_rollout_ref.actor.grad_clip)" in err
    )
    rc, err = dry_run(
        [*verl_args(VERL_GRPO, str(tmp_path)), "actor_rollout_ref.actor.strategy=megatron", "cluster=local"], capsys
    )
    assert rc == 2 and "strategy='megatron': the Megatron backend (strategy: fsdp or fsdp2" in err, err


def test_verls_hydra_config_options_name_the_base_or_are_refused(tmp_path, capsys):
    base = [*verl_args(VERL_GRPO, str(tmp_path)), "cluster=local"]
    for options in (["--config-path=config", "--config-name=ppo_trainer"], ["--config-name", "ppo_trainer.yaml"]):
        rc, err = dry_run([*options, *base], capsys)
        assert rc == 0, err
    for option, message in (
        ("--config-name=my_exp", "verl config files other than ppo_trainer are not read here"),
        ("--config-name=ppo_veomni_trainer", "the VeOmni backend"),
        ("--config-path=/home/me/configs", "a config directory of your own is not read here"),
    ):
        rc, err = dry_run([option, *base], capsys)
        assert rc == 2 and message in err and "recipe" in err or "VeOmni" in message, err
