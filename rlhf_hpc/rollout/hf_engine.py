"""The ``hf`` rollout engine: ``transformers`` generate behind the rollout interface.

For machines without vLLM and for debugging. It keeps its own inference copy of the model in the
rollout dtype (as vLLM does); that copy starts with random weights and must receive the actor's
weights through ``update_weights`` before the first ``generate``.
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch
import torch.distributed as dist

from rlhf_hpc.distributed.loading import materialize
from rlhf_hpc.models.hf import build_causal_lm, is_tiny, torch_dtype
from rlhf_hpc.models.moe_routing import RoutingReplay
from rlhf_hpc.rollout.base import Response, Sampling, covered

__all__ = ["HFEngine"]


def routed_experts(recorded: list[list[torch.Tensor]], row: int, prompt_len: int, width: int, new: int) -> torch.Tensor:
    """Row ``row``'s routing from one ``generate`` call: (prompt_len + new, layers, k) int16. The
    call's first forward (the prefill) routed the left-padded prompts, (rows x width) tokens; decode
    forward t routed each row's generated token t - 1. A row's last token is never fed back: its
    routing stays zero (the replay then routes it itself)."""
    layers, k = len(recorded), recorded[0][0].shape[-1]
    rows = recorded[0][0].shape[0] // width
    out = torch.zeros(prompt_len + new, layers, k, dtype=torch.int16)
    for layer, calls in enumerate(recorded):
        prefill = calls[0].view(rows, width, k)[row, width - prompt_len :]
        out[:prompt_len, layer] = prefill
        for t in range(1, min(new, len(calls))):
            out[prompt_len + t - 1, layer] = calls[t][row]
    return out


class HFEngine:
    name = "hf"
    adapter_rank = None  # takes a LoRA actor's merged weights (rlhf_hpc.rollout.weight_sync)

    def __init__(self, cfg, model_path: str, device: torch.device, tp_group=None, seed: int = 0):
        mcfg, rollout = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.rollout
        self.device = device
        # each rank generates alone (no tensor parallelism, tp_group unused): its data-parallel rank is its rank
        self.dp_rank = dist.get_rank() if dist.is_initialized() else 0
        # the structure only, straight on the device: the first update_weights fills it (nothing is
        # read from disk, no host copy); a random tiny model is built as it is
        dtype = torch_dtype(rollout.dtype)
        if is_tiny(model_path):
            self.model = build_causal_lm(model_path, dtype, device, mcfg.override_config, seed=cfg.trainer.seed)
        else:
            self.model = materialize(
                build_causal_lm(
                    model_path, dtype, "meta", mcfg.override_config, trust_remote_code=mcfg.trust_remote_code
                ),
                device,
            )
        self.model.eval().requires_grad_(False)
        # the experts each token was routed to, for the trainer to replay (actor.router_replay.mode=R3)
        self.routing = RoutingReplay(self.model) if rollout.enable_rollout_routing_replay else None
        self._params = dict(self.model.named_parameters())
        self._spec = {k: tuple(v.shape) for k, v in self._params.items()}
        self.synced = False
        self.seed = seed
        self._calls = 0

    def weight_spec(self) -> dict[str, tuple[int, ...]]:
        return dict(self._spec)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # a tied head is the embedding's parameter here too: filling one fills both
        for name, tensor in covered(named_tensors, self._spec):
            self._params[name].copy_(tensor)
        self.synced = True

    def release(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume(self) -> None:
        pass

    def close(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], sampling: Sampling) -> list[list[Response]]:
        if not self.synced:
            raise RuntimeError("hf engine: generate() before the first update_weights(); its weights are random")
        if not prompt_token_ids:  # a rank may hold no prompt of a small step
            return []
        prompts = [p for p in prompt_token_ids for _ in range(sampling.n)]
        width = max(len(p) for p in prompts)
        pad = 0
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: generation continues every row at the end
            ids[i, width - len(p) :] = torch.tensor(p)
            attn[i, width - len(p) :] = 1
        stops = [] if sampling.ignore_eos else list(sampling.stop_token_ids)
        kwargs = dict(
            max_new_tokens=sampling.max_tokens,
            eos_token_id=stops or None,
            pad_token_id=pad,
            output_scores=True,
            return_dict_in_generate=True,
            use_cache=True,
        )
        if sampling.greedy:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(
                do_sample=True,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else None,
            )
        self._calls += 1
        # sampling draws from the global RNG: fork it, so generation neither disturbs nor depends on
        # the trainer's stream, and one seed replays the same rollouts
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(sampling.seed if sampling.seed is not None else self.seed * 1_000_003 + self._calls)
            with self.routing.record() if self.routing is not None else contextlib.nullcontext() as recorded:
                out = self.model.generate(input_ids=ids.to(self.device), attention_mask=attn.to(self.device), **kwargs)
        new_dev = out.sequences[:, width:]
        new = new_dev.cpu()
        # scores are the processed logits the sampler drew from (after temperature/top-k/top-p);
        # one step at a time: a (rows, steps, vocab) stack would be the size of all the scores again
        picked = torch.stack(
            [
                torch.log_softmax(s.float(), -1).gather(-1, new_dev[:, t : t + 1]).squeeze(-1)
                for t, s in enumerate(out.scores)
            ],
            1,
        ).cpu()
        del out
        results = []
        for i in range(len(prompts)):
            toks, lps = new[i].tolist(), picked[i].tolist()
            end, reason = len(toks), "length"
            for j, t in enumerate(toks):
                if t in stops:
                    end, reason = j + 1, "stop"
                    break
            routed = None if recorded is None else routed_experts(recorded, i, len(prompts[i]), width, end)
            results.append(
                Response(token_ids=toks[:end], logprobs=lps[:end], finish_reason=reason, routed_experts=routed)
            )
        return [results[i * sampling.n : (i + 1) * sampling.n] for i in range(len(prompt_token_ids))]
