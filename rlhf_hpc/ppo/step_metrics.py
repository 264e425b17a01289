"""A step's metrics, global over ranks: statistics of the step batch (the reference's data
metrics), throughput, MFU and memory, and the time plan's model of the run."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from rlhf_hpc.config.schema import Config
from rlhf_hpc.distributed.process_group import DistContext, all_reduce_max, all_reduce_min, all_reduce_sum
from rlhf_hpc.observability.perf import Timer, memory_metrics, model_flops, peak_flops
from rlhf_hpc.ops import algos
from rlhf_hpc.planning.time_plan import TimeModel
from rlhf_hpc.tools.sandbox_metrics import METRIC_NAMES, SANDBOX_METRICS

__all__ = ["data_metrics", "perf_metrics", "reduce_stats", "sandbox_metrics", "time_model"]


def reduce_stats(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """``{name: 1-D tensor}`` -> name/mean, name/max, name/min over all ranks (three all-reduces)."""
    names = sorted(values)
    sums = torch.tensor(
        [[values[n].double().sum().item(), float(values[n].numel())] for n in names], dtype=torch.float64
    )
    maxs = torch.tensor(
        [values[n].max().item() if values[n].numel() else -math.inf for n in names], dtype=torch.float64
    )
    mins = torch.tensor([values[n].min().item() if values[n].numel() else math.inf for n in names], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        sums = all_reduce_sum(sums)
        maxs, mins = -all_reduce_min(-maxs), all_reduce_min(mins)
    out = {}
    for i, n in enumerate(names):
        out[f"{n}/mean"] = (sums[i, 0] / max(sums[i, 1], 1.0)).item()
        out[f"{n}/max"], out[f"{n}/min"] = maxs[i].item(), mins[i].item()
    return out


def sandbox_metrics() -> dict[str, float]:
    """The programs the ranks ran in the sandbox since the last step (a code reward's; the counts of
    ``rlhf_hpc.tools.sandbox_metrics``), summed over ranks: ``sandbox/runs``, one count per outcome
    (``sandbox/timeouts``, ...), ``sandbox/seconds_mean``/``_max``. Nothing when none ran."""
    mine = SANDBOX_METRICS.take_metrics()
    runs = mine.get("sandbox/runs", 0.0)
    names = list(METRIC_NAMES.values())
    totals = torch.tensor(
        [runs, runs * mine.get("sandbox/seconds_mean", 0.0), *(mine.get(n, 0.0) for n in names)], dtype=torch.float64
    )
    longest = torch.tensor([mine.get("sandbox/seconds_max", 0.0)], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        totals, longest = all_reduce_sum(totals), all_reduce_max(longest)
    if totals[0] == 0:
        return {}
    out = {
        "sandbox/runs": totals[0].item(),
        "sandbox/seconds_mean": (totals[1] / totals[0]).item(),
        "sandbox/seconds_max": longest[0].item(),
    }
    out.update({n: totals[2 + i].item() for i, n in enumerate(names)})
    return out


def data_metrics(batch: dict, entropy: Optional[torch.Tensor], use_critic: bool) -> dict[str, float]:
    """The reference's per-step data metrics, global over ranks. Lengths are of the responses as
    sampled; advantages, returns and values over the tokens trained (after rejection sampling)."""
    mask = batch["response_mask"].bool()
    resp_len = batch.get("sampled_response_mask", batch["response_mask"]).sum(-1).float()
    prompt_len = batch["attention_mask"].sum(-1).float() - resp_len
    R, P = mask.shape[1], batch["attention_mask"].shape[1] - mask.shape[1]
    values = {
        "critic/score": batch["token_scores"].sum(-1),
        "critic/rewards": batch["token_rewards"].sum(-1),
        "critic/advantages": batch["advantages"][mask],
        "critic/returns": batch["returns"][mask],
        "response_length": resp_len,
        "prompt_length": prompt_len,
    }
    if entropy is not None:  # None in bypass mode (no old-log-prob pass)
        values["actor/rollout_entropy"] = entropy[mask]
    if use_critic:
        values["critic/values"] = batch["values"][mask]
    out = reduce_stats(values)
    clipped = all_reduce_sum(
        torch.tensor(
            [(resp_len >= R).sum().item(), (prompt_len >= P).sum().item(), float(len(resp_len))], dtype=torch.float64
        )
    )
    out["response_length/clip_ratio"] = (clipped[0] / clipped[2]).item()
    out["prompt_length/clip_ratio"] = (clipped[1] / clipped[2]).item()
    out.update(sandbox_metrics())
    if use_critic:
        # explained variance of the returns by the values (1 = perfect value function)
        ret, val = batch["returns"][mask].double(), batch["values"][mask].double()
        s = all_reduce_sum(
            torch.stack(
                [
                    ret.sum(),
                    (ret**2).sum(),
                    (ret - val).sum(),
                    ((ret - val) ** 2).sum(),
                    torch.tensor(float(ret.numel()), dtype=torch.float64),
                ]
            )
        )
        n = max(s[4].item(), 1.0)
        var_ret = s[1].item() / n - (s[0].item() / n) ** 2
        var_err = s[3].item() / n - (s[2].item() / n) ** 2
        out["critic/vf_explained_var"] = 1.0 - var_err / (var_ret + 1e-8)
    # KL between the rollout policy and the reference, mean and variance over tokens
    if "ref_log_prob" in batch:
        kl = algos.kl_penalty(batch["old_log_probs"], batch["ref_log_prob"], "kl")[mask].double()
        s = all_reduce_sum(torch.stack([kl.sum(), (kl**2).sum(), torch.tensor(float(kl.numel()), dtype=torch.float64)]))
        n = max(s[2].item(), 1.0)
        out["actor/ref_kl_mean"] = s[0].item() / n
        out["actor/ref_kl_var"] = s[1].item() / n - (s[0].item() / n) ** 2
    return out


def time_model(cfg: Config, ctx: DistContext) -> Optional[TimeModel]:
    """The time plan's model of this run on its own GPU (or this CPU's calibration); None where the
    model's shape cannot be read."""
    try:
        return TimeModel(cfg, device_name=torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else None)
    except (FileNotFoundError, OSError, ValueError):
        return None


def perf_metrics(cfg: Config, ctx: DistContext, batch: dict, timer: Timer, model_cfg) -> dict[str, float]:
    times = timer.times
    # forward FLOPs of this rank's sequences (logits only on response tokens), summed over ranks
    local = torch.tensor(
        [
            float(batch["attention_mask"].sum()),
            model_flops(model_cfg, batch["attention_mask"].sum(-1).tolist(), float(batch["response_mask"].sum())),
        ],
        dtype=torch.float64,
    )
    tokens, fwd_flops = all_reduce_sum(local).tolist()
    step_s = times.get("timing_s/step", 0.0)
    out = {
        "perf/total_num_tokens": tokens,
        "perf/time_per_step": step_s,
        "perf/throughput": tokens / max(step_s, 1e-9) / ctx.world_size,
    }
    update_s = times.get("timing_s/update_actor")
    if update_s:
        # forward + backward = 3 x forward, per epoch
        flops = 3 * fwd_flops * cfg.actor_rollout_ref.actor.ppo_epochs
        out["perf/mfu/actor"] = flops / update_s / (peak_flops(ctx.device, cfg.hardware.bf16_tflops) * ctx.world_size)
    # memory: the largest rank's (what has to fit), run and phase peaks in one all-reduce
    mem = {**memory_metrics(ctx.device), **timer.peaks}
    names = sorted(mem)
    out.update(zip(names, all_reduce_max(torch.tensor([mem[n] for n in names], dtype=torch.float64)).tolist()))
    return out
