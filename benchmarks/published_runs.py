"""The time plan against published GPU runs (no GPU needed: the plan is arithmetic on the recipe,
the model's published shape and the H100 preset).

    python -m benchmarks.published_runs

The runs are NVIDIA NeMo-RL's synchronous, colocated GRPO runs of dense models on DGX H100 nodes
with their setups published: the v0.3 blog (per phase) and the performance summary of its docs
(the step only); and the summary's one-step-off run of the 8B (8 training GPUs beside 8 generating,
issue #55) and of the Qwen3-32B (32 beside 32), planned as this project's split layout, the 8B's
gain over its on-policy twin on the same GPUs. Each is
planned as this project would run its workload (FSDP2 and vLLM, the layout the plans choose), from
the recipe ``llama8b_grpo`` (NeMo-RL's grpo_math_8B: 64 prompts x 32
responses, 512 responses per optimizer step, sequences up to 4096 tokens) with the run's model,
nodes, vLLM tensor parallelism and lengths. Their trainers differ (Megatron-Core or DTensor with
tensor and pipeline parallelism); the two backends' own steps differ by up to 1.6x on the same job.

Mean prompt lengths: NeMo-RL's throughput counts prompt and generated tokens over all GPUs, so
tokens/s/GPU x step x GPUs / 2048 - the mean generated length is the mean prompt: 127 tokens on the
8B run of the summary (Llama's tokenizer), 104 on the Qwen3-32B run; used for every run of that model.

The reference design's Qwen2.5-7B KL-PPO on 8 x H100 (recipe qwen7b_klppo): 11.2k tokens/s, planned
at three response lengths (its lengths are not published).
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field

from rlhf_hpc.config.schema import Config
from rlhf_hpc.planning.split_plan import split_step
from rlhf_hpc.planning.time_plan import TimePlan, build_time_plan
from rlhf_hpc.recipe.load import load_config

__all__ = ["PUBLISHED_RUNS", "SPLIT_PAIRS", "PublishedRun", "plan_of_run"]

_BLOG = (
    "NeMo-RL v0.3 blog, 2025-07-21, table 1 (mean of steps 22-29; nvidia-nemo.github.io/blog/2025/07/21/nemo-rl-v0.3)"
)
_SUMMARY = (
    "NeMo-RL docs/about/performance-summary.md at {version} (mean of 5 steps), setup from "
    "examples/configs/recipes/llm/performance/{name}.yaml at that tag"
)
_V05, _V04 = "v0.5.0 (6c70893)", "v0.4 (cff17f8)"
_LLAMA8B, _LLAMA70B, _QWEN32B = (
    ("actor_rollout_ref.model.path=meta-llama/Llama-3.1-8B-Instruct", "plan.prompt_length=127"),
    ("actor_rollout_ref.model.path=meta-llama/Llama-3.1-70B", "plan.prompt_length=127"),
    ("actor_rollout_ref.model.path=Qwen/Qwen3-32B", "plan.prompt_length=104"),
)
_CHOSEN_CHECKPOINTING = "actor_rollout_ref.model.enable_gradient_checkpointing=null"


def split_4_4(nodes: int) -> tuple[str, ...]:
    """The split layout, one-step-off: ``nodes`` nodes of 4 trainer + 4 rollout ranks."""
    return (
        "actor_rollout_ref.hybrid_engine=false",
        f"trainer.nnodes={nodes}",
        "trainer.n_gpus_per_node=4",
        f"rollout.nnodes={nodes}",
        "rollout.n_gpus_per_node=4",
        "async_training.staleness_threshold=1",
        "async_training.trigger_parameter_sync_step=1",
    )


# (the one-step-off run, the on-policy run of the same recipe): NeMo-RL's 1.43x
SPLIT_PAIRS = (
    (
        "Llama-3.1-8B-Instruct, 8 + 8 x H100, one-step-off (split layout), Megatron (PP1), checkpointing",
        "Llama-3.1-8B-Instruct, 16 x H100, Megatron (PP2), checkpointing",
    ),
)


@dataclass(frozen=True)
class PublishedRun:
    """A published run: its setup as overrides of recipe ``llama8b_grpo``, its step and phases (s)."""

    name: str
    source: str
    overrides: tuple[str, ...]
    step_s: float
    phases: dict[str, float] = field(default_factory=dict)  # gen, update_weights, log_probs, update_actor
    held_out: bool = False  # first compared after the plan's GPU constants were set
    outlier: str = ""  # why the plan of this project's run cannot follow it


PUBLISHED_RUNS = [
    PublishedRun(
        "Llama-3.1-8B-Instruct, 8 x H100, Megatron",
        _BLOG,
        (*_LLAMA8B, "plan.response_length=795"),
        112,
        {"gen": 58, "update_weights": 5, "log_probs": 18, "update_actor": 28},
    ),
    PublishedRun(
        "Llama-3.1-8B-Instruct, 8 x H100, DTensor (FSDP2)",
        _BLOG,
        (*_LLAMA8B, "plan.response_length=777"),
        122,
        {"gen": 57, "update_weights": 4, "log_probs": 19, "update_actor": 38},
    ),
    PublishedRun(
        "Llama-3.1-70B, 64 x H100, Megatron (TP4 PP4), vLLM TP4",
        _BLOG,
        (
            *_LLAMA70B,
            "trainer.nnodes=8",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
            _CHOSEN_CHECKPOINTING,
            "plan.response_length=398",
        ),
        147,
        {"gen": 84, "update_weights": 14, "log_probs": 18, "update_actor": 28},
    ),
    PublishedRun(
        "Llama-3.1-70B, 64 x H100, DTensor (TP8, no checkpointing), vLLM TP4",
        _BLOG,
        (
            *_LLAMA70B,
            "trainer.nnodes=8",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
            _CHOSEN_CHECKPOINTING,
            "plan.response_length=395",
        ),
        230,
        {"gen": 82, "update_weights": 15, "log_probs": 28, "update_actor": 97},
        outlier="its training takes 3.5x the Megatron run's on the same job (dynamic batching in place of "
        "sequence packing after an out-of-memory, NeMo-RL's note)",
    ),
    PublishedRun(
        "Qwen3-32B, 64 x H100, Megatron (TP4 PP2), vLLM TP4 (not published: the summary's)",
        _BLOG,
        (
            *_QWEN32B,
            "trainer.nnodes=8",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
            _CHOSEN_CHECKPOINTING,
            "plan.response_length=3283",
        ),
        213,
        {"gen": 96, "update_weights": 7, "log_probs": 40, "update_actor": 68},
    ),
    PublishedRun(
        "Llama-3.1-8B-Instruct, 16 x H100, Megatron (PP2), checkpointing",
        _SUMMARY.format(version=_V05, name="grpo-llama3.1-8b-instruct-2n8g"),
        (
            *_LLAMA8B,
            "trainer.nnodes=2",
            "actor_rollout_ref.model.enable_gradient_checkpointing=true",
            "plan.response_length=1019",
        ),
        92.8,
        held_out=True,
    ),
    # NeMo-RL's one-step-off pair of the run above: 8 training GPUs (Megatron, PP1) beside 8 vLLM
    # engines (TP1), generation continuing through the weight updates; planned as this project's
    # split layout (its rollout ranks share the trainer's nodes: 4 + 4 on each of the 2)
    PublishedRun(
        "Llama-3.1-8B-Instruct, 8 + 8 x H100, one-step-off (split layout), Megatron (PP1), checkpointing",
        _SUMMARY.format(version=_V05, name="grpo-llama3.1-8b-instruct-2n8g-async-1off"),
        (
            *_LLAMA8B,
            *split_4_4(2),
            "actor_rollout_ref.model.enable_gradient_checkpointing=true",
            "plan.response_length=1123",
        ),
        64.8,
        held_out=True,
    ),
    # and the 32B's, on twice its on-policy run's GPUs: 32 training (TP4 PP4) beside 32 generating
    # (8 engines of TP4); planned as 8 nodes of 4 trainer + 4 rollout ranks
    PublishedRun(
        "Qwen3-32B, 32 + 32 x H100, one-step-off (split layout), Megatron (TP4 PP4), vLLM TP4",
        _SUMMARY.format(version=_V05, name="grpo-qwen3-32b-8n8g-async-1off"),
        (
            *_QWEN32B,
            *split_4_4(8),
            "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
            _CHOSEN_CHECKPOINTING,
            "plan.response_length=3252",
        ),
        200,
        held_out=True,
    ),
    PublishedRun(
        "Qwen3-32B, 32 x H100, Megatron (TP4 PP4), vLLM TP4, no checkpointing",
        _SUMMARY.format(version=_V05, name="grpo-qwen3-32b-4n8g"),
        (
            *_QWEN32B,
            "trainer.nnodes=4",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
            _CHOSEN_CHECKPOINTING,
            "plan.response_length=3251",
        ),
        376,
        held_out=True,
    ),
    # the same two recipes as the summary published them at v0.4 (cff17f8), an earlier NeMo-RL
    PublishedRun(
        "Llama-3.1-8B-Instruct, 16 x H100, Megatron (PP2), checkpointing; v0.4",
        _SUMMARY.format(version=_V04, name="grpo-llama3.1-8b-instruct-2n8g"),
        (
            *_LLAMA8B,
            "trainer.nnodes=2",
            "actor_rollout_ref.model.enable_gradient_checkpointing=true",
            "plan.response_length=1060",
        ),
        97.7,
        held_out=True,
    ),
    PublishedRun(
        "Qwen3-32B, 32 x H100, Megatron (TP4 PP4), vLLM TP4, no checkpointing; v0.4",
        _SUMMARY.format(version=_V04, name="grpo-qwen3-32b-4n8g"),
        (
            *_QWEN32B,
            "trainer.nnodes=4",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
            _CHOSEN_CHECKPOINTING,
            "plan.response_length=3206",
        ),
        393,
        held_out=True,
    ),
]
REFERENCE_TOKENS_S = 11_200


def planned_config(recipe: str, *overrides: str) -> Config:
    # the published runs ran on Slurm clusters: planned as such on any machine (launcher.cluster=auto
    # is "local" where no sbatch is installed, which refuses several nodes)
    cfg, _ = load_config(recipe, ("launcher.cluster=slurm", *overrides), check_files=False)
    return cfg


def planned(recipe: str, *overrides: str) -> TimePlan:
    return build_time_plan(planned_config(recipe, *overrides))


def plan_of_run(run: PublishedRun) -> tuple[TimePlan, dict[str, float]]:
    """(the plan of ``run``'s workload, its seconds under the published phases' names and ``step``).
    A split-layout run's plan is its trainer's; its ``step`` the split layout's (the trainer beside
    the rollout ranks' generation, ``rlhf_hpc.planning.split_plan``)."""
    cfg = planned_config("llama8b_grpo", *run.overrides)
    plan = build_time_plan(cfg)
    seconds = {p.name: p.seconds for p in plan.phases}
    gen, step = split_step(cfg, plan) if cfg.split else (seconds["gen"], plan.step_s)
    got = {
        "gen": gen,
        "update_weights": seconds["update_weights"],
        "log_probs": seconds.get("old_log_prob", 0.0) + seconds.get("ref", 0.0),
        "update_actor": seconds["update_actor"],
        "step": step,
    }
    return plan, got


def main() -> int:
    print(
        "| run | published step (s) | planned (s) | planned / published | phases planned / published "
        "(gen, refit, log-probs, training) |"
    )
    print("| --- | --- | --- | --- | --- |")
    ratios, held = [], []
    for run in PUBLISHED_RUNS:
        plan, got = plan_of_run(run)
        ratio = got["step"] / run.step_s
        (held if run.held_out else ratios).append(ratio)
        phases = ", ".join(f"{got[k]:.1f}/{v:g}" for k, v in run.phases.items()) or "not published"
        print(
            f"| {run.name}{' (held out)' if run.held_out else ''} | {run.step_s:g} | {got['step']:.1f} | "
            f"{ratio:.2f}{' (outlier: ' + run.outlier + ')' if run.outlier else ''} | {phases} |"
        )
    both = ratios + held
    print(
        f"\nplanned / published: median {statistics.median(both):.2f}, range {min(both):.2f}-{max(both):.2f} "
        f"({len(both)} runs; the {len(held)} held out: {', '.join(f'{r:.2f}' for r in held)})"
    )
    by_name = {run.name: run for run in PUBLISHED_RUNS}
    print("\n| one-step-off (split) against on-policy (colocated) | published gain | planned gain |")
    print("| --- | --- | --- |")
    for split, colocated in SPLIT_PAIRS:
        a, b = by_name[split], by_name[colocated]
        planned_gain = plan_of_run(b)[1]["step"] / plan_of_run(a)[1]["step"]
        print(f"| {split} | {b.step_s / a.step_s:.2f}x | {planned_gain:.2f}x |")
    print(
        f"\nreference design, Qwen2.5-7B KL-PPO (critic, GAE), 8 x H100 SXM, published {REFERENCE_TOKENS_S:,} tokens/s"
    )
    print("| mean response (tokens) | step (s) | tokens/s, all 8 GPUs | tokens/s per GPU | slowest phase |")
    print("| --- | --- | --- | --- | --- |")
    for response in (121, 250, 400):
        p = planned("qwen7b_klppo", "plan.prompt_length=100", f"plan.response_length={response}")
        slowest = max((x for x in p.phases if x.name != "save_checkpoint"), key=lambda x: x.seconds)
        print(
            f"| {response} | {p.step_s:.1f} | {p.tokens_per_s_per_gpu * p.world:,.0f} | "
            f"{p.tokens_per_s_per_gpu:,.0f} | "
            f"{slowest.name} {slowest.seconds:.1f} s ({slowest.bound}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
