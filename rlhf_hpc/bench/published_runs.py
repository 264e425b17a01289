"""The time plan against published GPU runs (no GPU needed: the plan is arithmetic on the recipe,
the model's published shape and the H100 preset).

    python -m rlhf_hpc.bench.published_runs

  NVIDIA NeMo-RL, Llama-3.1-8B-Instruct GRPO on 8 x H100 (recipe llama8b_grpo, their
  examples/configs/grpo_math_8B.yaml): 112-122 s per step, generation ~58 s, log-probs ~18 s,
  training ~28 s, weight refit 4-5 s, ~795 generated tokens per sample.
  The reference design's Qwen2.5-7B KL-PPO on 8 x H100 (recipe qwen7b_klppo): 11.2k tokens/s. GSM8K
  prompts measure ~100 tokens in Qwen2.5's chat template (94 with a generic system prompt, over the
  first 2000 training rows and ../shared's Qwen2 tokenizer); the response length of the run is not
  published, so the plan is given at the reference solutions' mean (121 tokens) and longer.
"""
from __future__ import annotations

import sys

from rlhf_hpc.planning.time_plan import build_time_plan
from rlhf_hpc.recipe.load import load_config

__all__: list[str] = []  # a script: nothing here is imported elsewhere

NEMO_RL = {"gen": (58, "generation ~58"), "update_weights": (4.5, "weight refit 4-5"),
           "log_probs": (18, "log-probs ~18"), "update_actor": (28, "training ~28"), "step": (117, "step 112-122")}
REFERENCE_TOKENS_S = 11_200


def planned(recipe: str, *overrides: str):
    cfg, _ = load_config(recipe, overrides, check_files=False)
    return build_time_plan(cfg)


def main() -> int:
    plan = planned("llama8b_grpo")
    got = {"gen": plan.phase("gen").seconds, "update_weights": plan.phase("update_weights").seconds,
           "log_probs": plan.phase("old_log_prob").seconds + plan.phase("ref").seconds,
           "update_actor": plan.phase("update_actor").seconds, "step": plan.step_s}
    print(f"NeMo-RL Llama-3.1-8B GRPO, 8 x H100 SXM: {plan.workload.rows} responses of {plan.workload.prompt:.0f} + "
          f"{plan.workload.response:.0f} tokens (longest {plan.workload.longest_response})")
    print("| phase | published (s) | planned (s) | planned / published | bound |")
    print("| --- | --- | --- | --- | --- |")
    for key, (published, text) in NEMO_RL.items():
        bound = plan.phase(key).bound if plan.phase(key) else ("compute" if key == "log_probs" else "-")
        print(f"| {key} | {text} | {got[key]:.1f} | {got[key] / published:.2f} | {bound} |")
    print(f"\nreference design, Qwen2.5-7B KL-PPO (critic, GAE), 8 x H100 SXM, published {REFERENCE_TOKENS_S:,} tokens/s")
    print("| mean response (tokens) | step (s) | tokens/s, all 8 GPUs | tokens/s per GPU | slowest phase |")
    print("| --- | --- | --- | --- | --- |")
    for response in (121, 250, 400):
        p = planned("qwen7b_klppo", "plan.prompt_length=100", f"plan.response_length={response}")
        slowest = max((x for x in p.phases if x.name != "save_checkpoint"), key=lambda x: x.seconds)
        print(f"| {response} | {p.step_s:.1f} | {p.tokens_per_s_per_gpu * p.world:,.0f} | {p.tokens_per_s_per_gpu:,.0f} | "
              f"{slowest.name} {slowest.seconds:.1f} s ({slowest.bound}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
