"""The whole configuration as a tree of typed dataclasses.

Key names and defaults follow the reference system (verl's ``ppo_trainer.yaml``) wherever the
feature is the same, so a verl recipe reads the same here. Deliberate differences are marked
``# differs from verl:`` with the reason.

A recipe (YAML in ``recipes/``) only fills these dataclasses in; see ``rlhf_hpc.recipe`` for
loading, inheritance, ``key=value`` overrides and validation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional, Union

from rlhf_hpc.config.async_schema import AsyncTrainingConfig, RolloutPoolConfig
from rlhf_hpc.config.job_schema import GlobalProfilerConfig, HardwareConfig, LauncherConfig, PlanConfig
from rlhf_hpc.config.multi_turn_schema import MultiTurnConfig
from rlhf_hpc.config.sandbox_schema import SandboxConfig, SandboxFusionConfig

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "ActorConfig",
    "AlgorithmConfig",
    "Config",
    "CriticConfig",
    "CriticModelConfig",
    "CustomClsConfig",
    "CustomRewardFunctionConfig",
    "DataConfig",
    "FSDPConfig",
    "FilterGroupsConfig",
    "GuardConfig",
    "KLControlConfig",
    "MixedPrecisionConfig",
    "ModelConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "RewardModelConfig",
    "RolloutCorrectionConfig",
]

# values of override_config.attn_implementation (verl's key); varlen: rlhf_hpc/models/attention.py
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "varlen")

KLKind = Literal[
    "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"
]
LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
Dtype = Literal["float32", "fp32", "bfloat16", "bf16", "float16", "fp16"]


@dataclass
class CustomClsConfig:
    # verl's custom dataset class: here only a class of verl's recipes that has an equivalent
    # (rlhf_hpc/config/verl_recipes.py: ReTool's CustomRLHFDataset) is accepted; any other is refused
    path: Optional[str] = None
    name: Optional[str] = None


@dataclass
class DataConfig:
    tokenizer: Optional[str] = None
    # a parquet file or a list of them; "synthetic://<task>" selects a task built in code
    train_files: Union[str, list[str]] = "~/data/gsm8k/train.parquet"
    val_files: Union[str, list[str], None] = "~/data/gsm8k/test.parquet"
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024
    val_batch_size: Optional[int] = None  # prompts per engine call in validation (null: all at once)
    truncation: Literal["error", "left", "right"] = "error"
    filter_overlong_prompts: bool = False
    # DAPO's dynamic sampling: prompts per generation batch (null: train_batch_size); only with
    # algorithm.filter_groups.enable (rlhf_hpc/ppo/dynamic_sampling.py)
    gen_batch_size: Optional[int] = None
    # extra keyword arguments of the tokenizer's apply_chat_template (e.g. enable_thinking: false)
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    shuffle: bool = True
    seed: int = 1
    # no loader processes here (prompts are tokenised once at start-up): only 0 is accepted
    dataloader_num_workers: int = 0
    custom_cls: CustomClsConfig = field(default_factory=CustomClsConfig)


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    # warm-up (rlhf_hpc.ppo.optim.lr_multiplier, verl's schedules): lr_warmup_steps when > 0, else
    # lr_warmup_steps_ratio x total steps; the LR rises as step / warmup from 0
    lr_warmup_steps: int = -1
    lr_warmup_steps_ratio: float = 0.0
    lr_scheduler_type: Literal["constant", "cosine"] = "constant"
    warmup_style: Optional[Literal["constant", "cosine"]] = None  # verl's deprecated name: sets lr_scheduler_type
    min_lr_ratio: float = 0.0  # cosine: the floor, as a fraction of lr
    num_cycles: float = 0.5  # cosine: 0.5 = one half-wave from lr to the floor
    # filled in by the trainer from the dataset size when left at -1
    total_training_steps: int = -1


@dataclass
class MixedPrecisionConfig:
    param_dtype: Dtype = "bfloat16"
    reduce_dtype: Dtype = "float32"
    buffer_dtype: Dtype = "float32"


@dataclass
class FSDPConfig:
    # differs from verl: null (the default) is chosen by the plans (rlhf_hpc.planning.layout_search):
    # the fastest shard group the time plan finds whose memory plan fits, e.g. 1 (replicate: no
    # all-gathers) for a small model, "GPUs per node" (HYBRID_SHARD: shard inside a node, replicate
    # across nodes) for a 7B; -1 = FULL_SHARD over the whole world (verl's default).
    fsdp_size: Optional[int] = None
    param_offload: bool = False
    optimizer_offload: bool = False
    offload_policy: bool = False
    # null: chosen with fsdp_size (rlhf_hpc.planning.layout): free after forward when sharded; prefetch on GPUs
    reshard_after_forward: Optional[bool] = None
    forward_prefetch: Optional[bool] = None
    # dtype the weights are kept in (a trained model's master copy, the optimizer's view); null (the
    # reference's and reward model's default) -> the model's compute dtype (mixed_precision.param_dtype):
    # a frozen model needs no master copy (verl keeps frozen models in bf16)
    model_dtype: Optional[Dtype] = "float32"
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)


@dataclass
class ModelConfig:
    # a Hugging Face directory or hub name (resolved from HF_HOME, never downloaded on compute
    # nodes), or "tiny://qwen2" for a tiny random-weight Qwen2 built in code
    path: str = "~/models/Qwen2.5-7B-Instruct"
    tokenizer_path: Optional[str] = None
    custom_chat_template: Optional[str] = None  # a Jinja chat template replacing the tokenizer's
    override_config: dict[str, Any] = field(default_factory=dict)
    # null: chosen from the memory a micro-batch's activations take (rlhf_hpc.planning.layout): off when
    # they are small, else on (verl's default, true)
    enable_gradient_checkpointing: Optional[bool] = None
    use_remove_padding: bool = True
    trust_remote_code: bool = False
    external_lib: Optional[str] = None  # a module imported before models are built (registers custom ones)
    # LoRA (verl's keys; PEFT adapters, rlhf_hpc.models.lora): on when lora_rank > 0 or an adapter is
    # loaded; the reference is then the actor with its adapter off (no second model)
    lora_rank: int = 0
    lora_alpha: int = 16
    target_modules: Union[str, list[str]] = "all-linear"
    exclude_modules: Optional[Union[str, list[str]]] = None
    lora_adapter_path: Optional[str] = None  # a PEFT adapter directory to continue training


@dataclass
class PolicyLossConfig:
    """verl's ``actor_rollout_ref.actor.policy_loss`` (its keys and defaults). A key only one loss
    reads is refused when set while another loss is selected (rlhf_hpc/recipe/config_checks.py)."""

    loss_mode: str = "vanilla"  # a name in rlhf_hpc.ops.policy_losses.POLICY_LOSSES
    clip_cov_ratio: float = 0.0002  # clip_cov: share of the valid tokens whose gradient it may drop
    clip_cov_lb: float = 1.0  # clip_cov: lower bound of the covariance of a token it may drop
    clip_cov_ub: float = 5.0  # clip_cov: upper bound of that covariance
    kl_cov_ratio: float = 0.0002  # kl_cov: share of the valid tokens (largest covariance) given the KL penalty
    ppo_kl_coef: float = 0.1  # kl_cov: coefficient of |log pi - log pi_old| on those tokens
    dro_beta: Optional[float] = None  # dro: weight of the quadratic log-ratio penalty (required, > 0)


@dataclass
class CheckpointConfig:
    """verl's ``checkpoint`` of a trained model: what each of its checkpoints holds (``model``: its
    shards; ``optimizer``: the optimizer's state; ``extra``: its LR schedule, and for the actor every
    rank's RNG state; ``hf_model``: a Hugging Face model directory, ``<model>/huggingface``, in its
    compute dtype) and what a resume loads (null: what is saved, as verl's ``${.save_contents}``).
    The trainer's own position (step, data, KL controller) is always saved (rlhf_hpc/ppo/checkpoint.py)."""

    save_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    load_contents: Optional[list[str]] = None


@dataclass
class RouterReplayConfig:
    """verl's ``actor_rollout_ref.actor.router_replay``: a mixture of experts' routing replayed in the
    trainer (rlhf_hpc.models.moe_routing). ``R3``: the experts the engine routed each token to
    (``rollout.enable_rollout_routing_replay``) in every actor forward; ``R2``: the old-log-prob
    pass's own routing in the update's forwards (any engine); ``disabled``: each side routes on its own."""

    mode: Literal["disabled", "R2", "R3"] = "disabled"


@dataclass
class ActorConfig:
    strategy: Literal["fsdp", "fsdp2"] = "fsdp2"  # "fsdp" is accepted and runs FSDP2
    ppo_mini_batch_size: int = 256  # in prompts; x rollout.n responses
    # differs from verl: null = the whole per-rank mini-batch in one micro-batch (verl requires it)
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1
    shuffle: bool = False
    grad_clip: float = 1.0
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None  # null -> clip_ratio
    clip_ratio_high: Optional[float] = None  # null -> clip_ratio
    clip_ratio_c: float = 3.0
    tau_pos: float = 1.0  # sapo: gate temperature of tokens with A > 0 (verl's actor.tau_pos)
    tau_neg: float = 1.05  # sapo: gate temperature of tokens with A <= 0
    loss_agg_mode: LossAggMode = "token-mean"
    entropy_coeff: float = 0.0
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: KLKind = "low_var_kl"
    # Ulysses: groups of this many ranks split each packed sequence (rlhf_hpc.distributed.sequence_parallel)
    ulysses_sequence_parallel_size: int = 1
    # the old-log-prob pass also gives sum_v pi(v)^2 per response token (batch["sum_pi_squared"]), which
    # the estimators declaring needs_sum_pi_squared read (verl's optimal_token_baseline requires it)
    calculate_sum_pi_squared: bool = False
    sum_pi_squared_checkpointing: bool = False  # verl's; only false here (the sum never has a graph)
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class ValKwargs:
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    n: int = 1
    do_sample: bool = False


@dataclass
class RolloutConfig:
    # a name in rlhf_hpc.config.engines.ENGINES, or auto: the first of AUTO_ORDER installed here (vllm, else hf)
    name: str = "vllm"
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    n: int = 1
    do_sample: bool = True
    ignore_eos: bool = False
    dtype: Dtype = "bfloat16"
    tensor_model_parallel_size: int = 2
    gpu_memory_utilization: float = 0.5
    free_cache_engine: bool = True
    enforce_eager: bool = False
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    max_model_len: Optional[int] = None
    enable_chunked_prefill: bool = True
    update_weights_bucket_mb: int = 512
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: Optional[bool] = None  # null -> actor.use_dynamic_bsz (as verl)
    log_prob_max_token_len_per_gpu: Optional[int] = None  # null -> actor.ppo_max_token_len_per_gpu
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)  # tools between turns (agent loop)
    # the engine returns the experts it routed each token to (a mixture of experts; actor.router_replay R3)
    enable_rollout_routing_replay: bool = False
    # verl's: every this many steps, rollout/moe/* (how evenly the recorded routing spread the
    # response tokens over the experts, rlhf_hpc.ops.moe_load_metrics); 0: never
    moe_load_balance_metrics_interval: int = 0


@dataclass
class RefConfig:
    strategy: Literal["fsdp", "fsdp2"] = "fsdp2"  # "fsdp" is accepted and runs FSDP2
    fsdp_config: FSDPConfig = field(default_factory=lambda: FSDPConfig(model_dtype=None))
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: Optional[bool] = None  # null -> actor.use_dynamic_bsz (as verl)
    log_prob_max_token_len_per_gpu: Optional[int] = None  # null -> actor.ppo_max_token_len_per_gpu
    ulysses_sequence_parallel_size: Optional[int] = None  # null -> actor's (as verl)


@dataclass
class ActorRolloutRefConfig:
    # actor and rollout share the GPUs; false: the split layout (rollout ranks apart, Config.rollout)
    hybrid_engine: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)


@dataclass
class CriticModelConfig:
    path: Optional[str] = None  # null -> actor_rollout_ref.model.path (value head initialised fresh)
    tokenizer_path: Optional[str] = None
    override_config: dict[str, Any] = field(default_factory=dict)
    enable_gradient_checkpointing: Optional[bool] = None  # null: chosen from its activations (rlhf_hpc.planning.layout)
    use_remove_padding: bool = True
    trust_remote_code: Optional[bool] = None  # null -> actor_rollout_ref.model's (as verl)
    external_lib: Optional[str] = None  # null -> actor_rollout_ref.model's (as verl)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    # LoRA on the critic's backbone (verl's keys); its value head trains in full
    lora_rank: int = 0
    lora_alpha: int = 16
    target_modules: Union[str, list[str]] = "all-linear"


@dataclass
class CriticConfig:
    enable: Optional[bool] = None  # null -> enabled exactly when the estimator needs a critic (gae)
    strategy: Literal["fsdp", "fsdp2"] = "fsdp2"
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    # "actor": null takes the actor's value, as verl interpolates it (${oc.select:actor_rollout_ref.actor...})
    ppo_mini_batch_size: Optional[int] = None  # actor
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # null: the whole per-rank mini-batch (as the actor)
    use_dynamic_bsz: Optional[bool] = None  # actor
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: Optional[int] = None  # null -> critic.ppo_max_token_len_per_gpu
    ppo_epochs: Optional[int] = None  # actor
    shuffle: Optional[bool] = None  # actor
    grad_clip: float = 1.0
    cliprange_value: float = 0.5
    loss_agg_mode: Optional[LossAggMode] = None  # actor
    ulysses_sequence_parallel_size: int = 1  # as verl: not the actor's


@dataclass
class RewardModelSubConfig:
    # a sequence-classification checkpoint (one label), e.g. a Qwen2ForSequenceClassification reward
    # model, or "tiny://qwen2?..." for a tiny random-weight one built in code (tests, the CPU demo)
    path: str = "~/models/reward-model"
    # differs from verl (default: the actor's model path, i.e. always re-encode): null = the reward
    # model reads the actor's tokens as they are where its tokenizer and chat template are the actor's,
    # and re-encodes where they differ; set (to the actor's tokenizer): always re-encode.
    input_tokenizer: Optional[str] = None
    trust_remote_code: bool = False
    external_lib: Optional[str] = None  # null -> actor_rollout_ref.model's (as verl)
    override_config: dict[str, Any] = field(default_factory=dict)
    # differs from verl (false): packed rows like the actor's (no compute on padding)
    use_remove_padding: bool = True
    fsdp_config: FSDPConfig = field(default_factory=lambda: FSDPConfig(model_dtype=None))


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping (``reward_manager: dapo``): a response longer than
    data.max_response_length - len gets a penalty growing linearly to -penalty_factor (verl's keys)."""

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0
    log: bool = False


@dataclass
class RewardModelConfig:
    """A reward model on the training mesh, inference only (rlhf_hpc/rewards/reward_model.py).
    Its score replaces the rule/custom score of a response in training (verl's naive reward
    manager); validation still scores with the rule/custom function."""

    enable: bool = False
    strategy: Literal["fsdp", "fsdp2"] = "fsdp2"  # "fsdp" is accepted and runs FSDP2
    model: RewardModelSubConfig = field(default_factory=RewardModelSubConfig)
    # differs from verl (required there): null -> actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu
    micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: Optional[bool] = None  # null -> critic.use_dynamic_bsz (as verl)
    forward_max_token_len_per_gpu: Optional[int] = None  # null -> critic.forward_max_token_len_per_gpu (as verl)
    # re-encoded sequences (model.input_tokenizer set) are cut on the right to this many tokens;
    # null: data.max_prompt_length + data.max_response_length (as verl)
    max_length: Optional[int] = None
    # naive: the score as it is; dapo: plus overlong_buffer's shaping (rlhf_hpc/rewards/overlong.py)
    reward_manager: Literal["naive", "dapo"] = "naive"
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)  # url: code runs on that service


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None
    name: str = "compute_score"


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class RolloutCorrectionConfig:
    """verl's ``algorithm.rollout_correction``: the engine samples from its own distribution
    (pi_rollout: its kernels, its precision), the actor trains another (rlhf_hpc.ops.rollout_corr_helper).

    ``rollout_is``: importance sampling, ``token`` or ``sequence`` weights pi_old / pi_rollout
    capped at ``rollout_is_threshold`` (or zeroed outside its ``"lower_upper"`` window: IcePop),
    multiplying the PPO loss per token;
    ``rollout_is_batch_normalize`` divides them by their batch mean. ``rollout_rs``: rejection
    sampling, a comma-separated list of ``token_k1..k3``, ``seq_sum_k1..k3``, ``seq_mean_k1..k3``,
    ``seq_max_k2/k3`` with ``rollout_rs_threshold`` (``"lower_upper"`` or one value for k1, an
    upper bound for k2/k3; one entry, or one per option): rejected tokens/rows leave the response
    mask before advantages. ``bypass_mode``: the engine's log-probs are the PPO anchor
    (old_log_probs) and the actor's old-log-prob forward is skipped (verl's 2-policy mode); the
    correction then compares the current policy with the engine's per micro-batch, and
    ``loss_type: reinforce`` trains -A log pi w instead of the clipped ratio. verl's defaults."""

    rollout_is: Optional[Literal["token", "sequence"]] = None
    rollout_is_threshold: Union[float, str] = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Optional[Union[float, str]] = None
    bypass_mode: bool = False
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (verl's keys): the groups whose ``metric`` has zero variance over
    their responses are dropped, and generation repeats (data.gen_batch_size prompts at a time)
    until data.train_batch_size prompts remain; max_num_gen_batches <= 0: no limit."""

    enable: bool = False
    metric: Optional[Literal["acc", "score", "seq_reward", "seq_final_reward"]] = None
    max_num_gen_batches: int = 0


@dataclass
class PfPpoConfig:
    """verl's ``algorithm.pf_ppo``: how a response's score weighs its draws."""

    reweight_method: Literal["pow", "max_min", "max_random"] = "pow"
    weight_pow: float = 2.0  # pow: |score| ^ weight_pow


@dataclass
class AlgorithmConfig:
    gamma: float = 1.0
    lam: float = 1.0
    adv_estimator: str = "gae"  # a name in rlhf_hpc.ops.estimators.ADV_ESTIMATORS
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: KLKind = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    # gdpo: the keys of the reward function's dict result normalised apart (GRPO per key), and their
    # weights in the sum (null: 1 each); read only by adv_estimator=gdpo (verl's)
    gdpo_reward_keys: Optional[list[str]] = None
    gdpo_reward_weights: Optional[list[float]] = None
    # PF-PPO (rlhf_hpc/ops/pf_ppo.py): after the advantages, the step's responses resampled with
    # replacement, weighted by their scores; with adv_estimator=gae only, as verl
    use_pf_ppo: bool = False
    pf_ppo: PfPpoConfig = field(default_factory=lambda: PfPpoConfig())


@dataclass
class GuardConfig:
    """Divergence checks after every step; a trip rolls back to the last good checkpoint."""

    enable: bool = True
    max_kl: Optional[float] = None  # KL(actor || reference) per token above which the step is rejected
    kl_rise_threshold: Optional[float] = None  # ... or above this for kl_rise_steps steps in a row
    kl_rise_steps: int = 3
    vf_jump_factor: Optional[float] = 10.0  # value loss over this x the median of the last `window` steps
    # scale-free collapse checks against the run's own recent level (the median of the last
    # `window` steps): the rollouts' entropy falling below entropy_drop x it (a policy collapsed onto
    # a few tokens), and KL(actor || reference) above kl_jump_factor x it and above kl_jump_floor (a
    # KL that small is no collapse: the demo's triples 0.04 -> 0.13 in a healthy early step)
    entropy_drop: Optional[float] = 0.2
    kl_jump_factor: Optional[float] = 3.0
    kl_jump_floor: float = 1.0
    window: int = 5
    # a checkpoint of the starting point (global_step_0) when a fresh run begins, so a step that
    # diverges before the first save has something to roll back to (needs trainer.save_freq > 0)
    initial_checkpoint: bool = True
    lr_decay: float = 0.5  # actor LR multiplier applied at each rollback
    kl_coef_mult: float = 1.0  # KL coefficient multiplier at each rollback (in reward and in loss)
    max_rollbacks: int = 3


@dataclass
class TrainerConfig:
    project_name: str = "rlhf-hpc"
    experiment_name: str = "gsm8k-klppo"
    recipe: Optional[str] = None  # set by launch.py: the recipe the run started from
    wandb_group: Optional[str] = None  # null: the recipe (runs of one recipe and a sweep's elements share it)
    # "auto": cuda when torch sees a GPU, else cpu (gloo)
    device: Literal["auto", "cuda", "cpu"] = "auto"
    nnodes: int = 1
    # ranks per node: GPUs on a GPU node, processes on a CPU machine
    n_gpus_per_node: int = 8
    total_epochs: int = 30
    total_training_steps: Optional[int] = None
    # a bare string is taken as a one-item list (as verl does); mlflow: MLFLOW_TRACKING_URI, else a
    # file store in <run dir>/mlruns (rlhf_hpc/observability/tracking.py)
    logger: list[str] = field(default_factory=lambda: ["console", "wandb"])  # names in observability.tracking.TRACKERS
    # N > 0: at each validation, N (prompt, response, score) rows (verl's choice) to <run dir>/val_generations.jsonl
    # and to the trackers that show tables (W&B table, TensorBoard text, MLflow artifact)
    log_val_generations: int = 0
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = True
    # verl's evaluation run: validate once (the model, or the checkpoint resume_mode loads) and stop, no training
    val_only: bool = False
    critic_warmup: int = 0  # the actor is not updated while critic_warmup > step (steps count from 1)
    # assign a step's rows to ranks so each rank's token count is as even as possible
    balance_batch: bool = True
    resume_mode: str = "auto"  # auto | disable | <path to a global_step_N directory>
    # the run directory: checkpoints, metrics.jsonl, the resolved config.yaml, logs
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    max_ckpt_to_keep: Optional[int] = None
    seed: int = 42
    # process-group timeout; long enough for the slowest rank's checkpoint write
    dist_timeout_s: int = 1800
    # deprecated: hardware.bf16_tflops (copied there by rlhf_hpc/recipe/defaults.py, with a warning)
    peak_tflops: Optional[float] = None
    # deprecated: hardware.hbm_gb (copied there by rlhf_hpc/recipe/defaults.py, with a warning)
    gpu_memory_gb: Optional[float] = None
    # refuse to start with less free space than this where the run directory lives
    min_free_disk_gb: float = 1.0
    guard: GuardConfig = field(default_factory=GuardConfig)
    # testing: make a fault happen on purpose, "KIND@STEP[:RANK]" with KIND in nan_grad, lr_x1000,
    # kill (this rank dies mid-step, first attempt only), kill_in_save, wrong_weights (that step's
    # weight sync sends wrong weights; 0: the preflight's), slow (every step from STEP on 1 s
    # longer): rlhf_hpc/ppo/faults.py
    inject_fault: Optional[str] = None
    # the job checks the allocation instead of training (rlhf_hpc/preflight.py); set by
    # `launch.py preflight recipe=...`, which also puts the job in <run dir>/preflight
    preflight: bool = False


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    global_profiler: GlobalProfilerConfig = field(default_factory=GlobalProfilerConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # untrusted code on the node (rlhf_hpc/tools)
    rollout: RolloutPoolConfig = field(default_factory=RolloutPoolConfig)  # the split layout's rollout ranks
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    # not a key: the dotted keys the recipe file (with its bases) set, before overrides and
    # defaults (rlhf_hpc.recipe.load.load_config; a run keeps them in RUN_DIR/recipe.yaml). Advice
    # never asks to change what the recipe chose (rlhf_hpc.observability.profiling.CommHint).
    recipe_keys: ClassVar[frozenset] = frozenset()
    recipe_tree: ClassVar[Optional[dict]] = None  # that recipe mapping itself

    @property
    def world_size(self) -> int:
        """The trainer's ranks (the training mesh), the rollout ranks of the split layout aside."""
        return self.trainer.nnodes * self.trainer.n_gpus_per_node

    @property
    def split(self) -> bool:
        """The split layout: rollout ranks apart from the trainer's (``hybrid_engine=false``)."""
        return not self.actor_rollout_ref.hybrid_engine

    @property
    def rollout_world_size(self) -> int:
        return self.rollout.nnodes * self.rollout.n_gpus_per_node if self.split else 0

    @property
    def procs_per_node(self) -> int:
        """torchrun's processes on a node: the trainer's, then the split layout's rollout ranks."""
        return self.trainer.n_gpus_per_node + (self.rollout.n_gpus_per_node if self.split else 0)
