"""A step's rows and batch: the engine's responses as rows, the padded step batch the phases fill
in (its keys: ``rlhf_hpc.ppo.trainer``), the sampling settings and seeds, and the scores on the
responses' last tokens."""

from __future__ import annotations

import zlib
from typing import Optional

import torch

from rlhf_hpc.config.schema import Config
from rlhf_hpc.data.dataset import Example
from rlhf_hpc.distributed.rows import RolloutRow
from rlhf_hpc.models.tokenizer import stop_token_ids
from rlhf_hpc.ops.batching import make_padded_batch
from rlhf_hpc.rewards import RewardFunction
from rlhf_hpc.rollout.base import Sampling

__all__ = [
    "make_step_batch",
    "response_spans",
    "reward_extra_info",
    "rollout_rows",
    "routed_experts_batch",
    "sampling_for",
    "score_responses",
    "scores_on_last_token",
    "step_seed",
]


def rollout_rows(train: list[Example], prompts: list[int], mine: range, responses) -> list[RolloutRow]:
    """This rank's generated responses as rows: ``responses[i]`` answers prompt ``mine[i]`` of the
    step (``prompts`` holds the step's dataset indices)."""
    return [
        RolloutRow(
            prompt_pos=pos,
            example=prompts[pos],
            prompt_ids=train[prompts[pos]].prompt_ids,
            token_ids=list(r.token_ids),
            logprobs=list(r.logprobs),
            finish_reason=r.finish_reason,
            mask=r.mask,
            num_turns=r.num_turns,
            routed_experts=r.routed_experts,
        )
        for pos, group in zip(mine, responses)
        for r in group
    ]


def step_seed(seed: int, step: int, dp_rank: int) -> int:
    """Sampling seed of a step on a rollout data-parallel rank (the engine's ``dp_rank``: the ranks
    of one tensor-parallel group share it): a resumed run draws exactly the same rollouts."""
    return zlib.crc32(f"{seed}/{step}/{dp_rank}".encode()) & 0x7FFFFFFF


def sampling_for(
    cfg: Config, tokenizer, seed: Optional[int] = None, validation: bool = False, greedy: bool = False
) -> Sampling:
    """The rollout's sampling (``rollout.*``), validation's (``rollout.val_kwargs``), or ``greedy``:
    one greedy response per prompt (verl's ``do_sample=False`` generation, ReMax's baseline). A
    multi-turn run samples as verl's agent loop, which reads no ``do_sample``: greedy at temperature 0
    only (ReTool validates with val_kwargs temperature 1.0, top_p 0.6 and do_sample left false)."""
    r = cfg.actor_rollout_ref.rollout
    agent = r.multi_turn.enable
    stops = stop_token_ids(tokenizer, cfg.actor_rollout_ref.model.path)
    if greedy:
        return Sampling(
            n=1,
            temperature=0.0,
            top_p=1.0,
            top_k=-1,
            do_sample=False,
            max_tokens=cfg.data.max_response_length,
            stop_token_ids=stops,
            ignore_eos=r.ignore_eos,
            seed=seed,
        )
    if validation:
        v = r.val_kwargs
        return Sampling(
            n=v.n,
            temperature=v.temperature,
            top_p=v.top_p,
            top_k=v.top_k,
            do_sample=v.temperature > 0 if agent else v.do_sample,
            max_tokens=cfg.data.max_response_length,
            stop_token_ids=stops,
            ignore_eos=r.ignore_eos,
            seed=seed,
        )
    return Sampling(
        n=r.n,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        do_sample=r.temperature > 0 if agent else r.do_sample,
        max_tokens=cfg.data.max_response_length,
        stop_token_ids=stops,
        ignore_eos=r.ignore_eos,
        seed=seed,
    )


def make_step_batch(cfg: Config, tokenizer, rows: list[RolloutRow]) -> dict:
    """This rank's rows -> the padded step batch; ``uid`` is the prompt's position in the step. A
    multi-turn row's tool turns stay in ``attention_mask`` (the model reads them) and leave
    ``response_mask`` (nothing trains on them)."""
    P, R = cfg.data.max_prompt_length, cfg.data.max_response_length
    batch = make_padded_batch(
        [r.prompt_ids for r in rows], [r.token_ids[:R] for r in rows], tokenizer.pad_token_id or 0, P, R
    )
    engine_lp = torch.zeros(len(rows), R)
    for i, r in enumerate(rows):
        lp = r.logprobs[:R]
        engine_lp[i, : len(lp)] = torch.tensor(lp)
        if r.mask is not None:
            batch["response_mask"][i, : len(lp)] = torch.tensor(r.mask[:R], dtype=batch["response_mask"].dtype)
    batch["engine_log_probs"] = engine_lp
    batch["uid"] = torch.tensor([r.prompt_pos for r in rows])
    if rows and rows[0].routed_experts is not None:
        batch["routed_experts"] = routed_experts_batch(rows, P, R)
    return batch


def routed_experts_batch(rows: list[RolloutRow], P: int, R: int) -> torch.Tensor:
    """The rows' routing in the padded layout of ``input_ids``: (B, P + R, layers, k) int16, each
    prompt's ending at column P, each response's starting there; zero where nothing was routed."""
    _, layers, k = rows[0].routed_experts.shape
    out = torch.zeros(len(rows), P + R, layers, k, dtype=torch.int16)
    for i, r in enumerate(rows):
        p, n = len(r.prompt_ids), min(len(r.token_ids), R)
        out[i, P - p : P + n] = r.routed_experts[: p + n]
    return out


def score_responses(
    reward_fn: RewardFunction,
    tokenizer,
    train: list[Example],
    rows: list[RolloutRow],
    batch: dict,
    keys: tuple[str, ...] = (),
) -> torch.Tensor:
    """(B,) rule/custom scores of the decoded responses; with ``keys`` (gdpo's reward keys) also
    ``batch["reward_components"]``, (B, K): those keys of the reward function's dict results."""
    calls = []
    span = response_spans(batch)
    for i, row in enumerate(rows):
        n = int(span[i])
        text = tokenizer.decode(batch["responses"][i, :n].tolist(), skip_special_tokens=True)
        ex = train[row.example]
        calls.append((ex.data_source, text, ex.ground_truth, reward_extra_info(ex.extra_info, row.num_turns), ex.index))
    if not keys:
        return torch.tensor(reward_fn.score_all(calls), dtype=torch.float32)
    results = reward_fn.score_all(calls, keys)
    batch["reward_components"] = torch.tensor([values for _, values in results], dtype=torch.float32).reshape(
        len(results), len(keys)
    )
    return torch.tensor([score for score, _ in results], dtype=torch.float32)


def reward_extra_info(extra_info: dict, num_turns: Optional[int]) -> dict:
    """The row's ``extra_info`` as a reward reads it: a multi-turn response's ``num_turns`` added, as
    verl's reward manager adds it (ReTool's reward reads it)."""
    return extra_info if num_turns is None else {**extra_info, "num_turns": num_turns}


def response_spans(batch: dict) -> torch.Tensor:
    """(B,) tokens after each row's prompt, tool turns included (the text a reward reads, as verl)."""
    R = batch["responses"].shape[1]
    return batch["attention_mask"][:, -R:].sum(-1)


def scores_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) scores -> (B, R) with each score on its row's last valid response token (the model's
    last token: a multi-turn row may end in a tool turn, which the mask leaves out)."""
    token_scores = torch.zeros(response_mask.shape, dtype=torch.float32)
    positions = torch.arange(1, response_mask.shape[1] + 1).expand_as(response_mask)
    last = (positions * (response_mask > 0)).max(-1).values  # 1-based, 0: no valid token
    has = last > 0
    token_scores[has.nonzero().squeeze(-1), (last[has] - 1)] = scores[has]
    return token_scores
