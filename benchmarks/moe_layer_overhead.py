"""What a routed layer costs beside a dense one in the project's log-prob pass (BENCHMARKS.md,
"Mixtures of experts"):

    python -m benchmarks.moe_layer_overhead [--rows 4 16]

One process, one thread, the model wrapped as the calibration bench wraps its own (FSDP2,
replicated): the best of 5 x 5 forward passes over ``rows`` rows of 32 + 8 tokens, through 1 and 3
layers of the tiny Qwen2 and of the tiny Qwen3-MoE with several expert counts. Prints each model's
seconds per layer (the 3-layer pass minus the 1-layer one, halved) and the routed layer's excess
over the dense one (its experts' FLOPs differ from the dense MLP's: the excess is not all overhead).
"""

from __future__ import annotations

import argparse
import os

import torch

DENSE = "tiny://qwen2?vocab_size=64&num_hidden_layers={layers}"
ROUTED = "tiny://qwen3_moe?vocab_size=64&num_experts={experts}&num_experts_per_tok={k}&num_hidden_layers={layers}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 16])
    args = ap.parse_args()
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29534"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    import torch.distributed as dist

    from rlhf_hpc.hardware_checks.calibrate import best_time, log_prob_pass, replicated
    from rlhf_hpc.models.hf import build_causal_lm
    from rlhf_hpc.ops.batching import make_padded_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo")

    def per_layer(path: str, batch) -> float:
        times = {}
        for layers in (1, 3):
            model = replicated(build_causal_lm(path.format(layers=layers), torch.float32))
            times[layers] = best_time(lambda: log_prob_pass(model, batch), calls=5)
        return (times[3] - times[1]) / 2

    for rows in args.rows:
        batch = make_padded_batch([list(range(1, 33))] * rows, [list(range(1, 9))] * rows, 0, 32, 8)
        dense = per_layer(DENSE, batch)
        print(f"{rows} rows of 40 tokens: dense layer {dense * 1e3:.3f} ms")
        for experts, k in ((8, 2), (16, 2), (64, 2), (64, 4)):
            routed = per_layer(ROUTED.replace("{experts}", str(experts)).replace("{k}", str(k)), batch)
            print(f"  {experts} experts, {k} per token: {routed * 1e3:.3f} ms, {(routed - dense) * 1e3:+.3f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
