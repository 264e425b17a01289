"""A reward model on the training mesh (``reward_model.enable``): inference only, FSDP2-sharded
like the reference model, one scalar score per response at its last valid token.

The checkpoint is a sequence-classification model with one label (``AutoModelForSequenceClassification``,
e.g. ``Qwen2ForSequenceClassification``). transformers' own forward pools the score at the last
non-pad token of each padded row, which cannot see the sequences of a packed row; so the model runs
as a per-token scorer (``rlhf_hpc.models.hf.TokenScorer``: ``(B, L)`` tokens -> ``(B, L)`` scores) and
the score is read here at each sequence's last valid token, packed or padded. This is what verl's
reward worker does with the same weights loaded as a token classifier.

Input: the step batch's ``input_ids`` / ``attention_mask`` / ``position_ids`` (``(B, P + R)``,
prompt left-padded, response right-padded) when the reward model reads the actor's tokens; or,
with ``reward_model.model.input_tokenizer`` set, each response decoded with the actor's tokenizer,
appended to its prompt's chat messages as the assistant turn and re-encoded through the reward
model's chat template (cut on the right to ``reward_model.max_length``), as verl does. A reward
model whose tokenizer differs from the actor's (vocabulary or chat template) is re-encoded for
even with ``input_tokenizer`` unset: its own tokens are the only ones it can read.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from rlhf_hpc.config.schema import RewardModelConfig
from rlhf_hpc.distributed.loading import build_sharded
from rlhf_hpc.distributed.process_group import all_reduce_max_int
from rlhf_hpc.models.hf import attn_implementation, build_token_scorer, import_external_libs, is_tiny, torch_dtype
from rlhf_hpc.models.tokenizer import load_tokenizer
from rlhf_hpc.ops.batching import (
    Batch,
    dummy_rows,
    micro_batch_groups,
    position_ids_from_mask,
    restore_order,
    select_rows,
    to_device,
)

__all__ = ["RewardModel", "build_reward_model", "needs_reencoding"]


def last_token_scores(model: nn.Module, batch: Batch, remove_padding: bool) -> torch.Tensor:
    """(B,) scores at each row's last valid token (``attention_mask`` marks the valid tokens, which
    are contiguous in a row). ``remove_padding`` packs the rows into one (1, N) sequence with
    restarting position ids."""
    mask = batch["attention_mask"].bool()
    if remove_padding:
        lengths = mask.sum(-1)
        ids = batch["input_ids"][mask].unsqueeze(0)
        pos = torch.cat([torch.arange(int(n)) for n in lengths.tolist()]).unsqueeze(0).to(ids.device)
        scores = model(input_ids=ids, position_ids=pos, attention_mask=None)[0]  # (N,)
        return scores[torch.cumsum(lengths, 0) - 1]
    scores = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    )  # (B, L)
    last = (torch.arange(mask.shape[1], device=mask.device) * mask).argmax(-1)
    return scores[torch.arange(mask.shape[0], device=mask.device), last]


class RewardModel:
    """The reward model, built on the mesh (or a plain module), and how it reads responses.

    ``tokenizer``: the reward model's own; ``input_tokenizer``: the actor's, set only when the
    responses must be re-encoded (``reward_model.model.input_tokenizer``). ``sync_max``: max over
    ranks, so every rank runs the same number of micro-batches (each forward is a collective).
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: RewardModelConfig,
        tokenizer=None,
        input_tokenizer=None,
        max_length: Optional[int] = None,
        sync_max: Optional[Callable[[int], int]] = None,
        device: torch.device = torch.device("cpu"),
    ):
        self.model, self.cfg, self.device, self.sync_max = model, cfg, device, sync_max
        self.tokenizer, self.input_tokenizer, self.max_length = tokenizer, input_tokenizer, max_length

    def reencode(self, batch: Batch, chats: list[list[dict]]) -> Batch:
        """Each response decoded with the actor's tokenizer, appended to its prompt's chat as the
        assistant turn, and re-encoded through the reward model's chat template: a right-padded
        batch, each row cut on the right to ``max_length`` tokens."""
        src, dst = self.input_tokenizer, self.tokenizer
        max_length = self.max_length or batch["input_ids"].shape[1]
        rows = []
        for i, chat in enumerate(chats):
            n = int(batch["response_mask"][i].sum())
            text = src.decode(batch["responses"][i, :n].tolist())
            if src.eos_token:
                text = text.replace(src.eos_token, "")
            rendered = dst.apply_chat_template(
                [*chat, {"role": "assistant", "content": text}], add_generation_prompt=False, tokenize=False
            )
            rows.append(dst(rendered, add_special_tokens=False)["input_ids"][:max_length])
        L = max(len(r) for r in rows)
        ids = torch.full((len(rows), L), dst.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros(len(rows), L, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r, dtype=torch.long), 1
        return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)}

    @torch.no_grad()
    def score(self, batch: Batch, chats: Optional[list[list[dict]]] = None) -> torch.Tensor:
        """(B,) float32 scores, one per row of the step batch, in its row order. ``chats``: each
        row's prompt messages (needed only to re-encode)."""
        self.model.eval()
        if self.input_tokenizer is not None:
            rm_batch = self.reencode(batch, chats)
        else:
            rm_batch = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
        cfg = self.cfg
        groups = micro_batch_groups(
            rm_batch,
            cfg.micro_batch_size_per_gpu or len(rm_batch["input_ids"]),
            bool(cfg.use_dynamic_bsz),
            cfg.forward_max_token_len_per_gpu or 0,
            self.sync_max,
        )
        outs, kept = [], []
        for g in groups:
            micro = to_device(select_rows(rm_batch, g) if g else dummy_rows(rm_batch), self.device)
            s = last_token_scores(self.model, micro, cfg.model.use_remove_padding)
            if g:
                outs.append(s.cpu())
                kept.append(g)
        return restore_order(outs, kept)


def needs_reencoding(rm_tokenizer, actor_tokenizer) -> bool:
    """Whether the reward model cannot read the actor's token ids as they are: another vocabulary,
    or another chat template around the same conversation."""
    return rm_tokenizer.get_vocab() != actor_tokenizer.get_vocab() or getattr(
        rm_tokenizer, "chat_template", None
    ) != getattr(actor_tokenizer, "chat_template", None)


def build_reward_model(cfg, ctx, input_tokenizer) -> RewardModel:
    """The reward model of ``cfg.reward_model`` sharded over the training mesh (collective; its
    checkpoint is read by rank 0 only, rlhf_hpc.distributed.loading). ``input_tokenizer``: the actor's
    tokenizer (responses are re-encoded when ``reward_model.model.input_tokenizer`` is set, or when
    the reward model's own tokenizer differs: ``needs_reencoding``)."""
    rm = cfg.reward_model
    m = rm.model
    import_external_libs(m.external_lib)
    attn = attn_implementation(ctx.device, m.override_config)
    model = build_sharded(
        lambda device: build_token_scorer(
            m.path,
            torch_dtype(m.fsdp_config.model_dtype),
            m.override_config,
            cfg.trainer.seed + 2,
            m.trust_remote_code,
            attn,
            device,
        ),
        m.fsdp_config,
        ctx,
        False,
        not is_tiny(m.path),
        frozen=True,
    )  # inference only
    try:
        tokenizer = load_tokenizer("tiny://chars" if m.path.startswith("tiny://") else m.path, m.trust_remote_code)
    except (OSError, ValueError, TypeError, KeyError):  # (what transformers raises for missing files varies)
        if m.input_tokenizer is not None:  # re-encoding asked for: it needs the reward model's own
            raise
        tokenizer = None  # a checkpoint without tokenizer files: it can only read the actor's tokens
    comparable = tokenizer is not None and input_tokenizer is not None
    reencode = m.input_tokenizer is not None or (comparable and needs_reencoding(tokenizer, input_tokenizer))
    if reencode and m.input_tokenizer is None and ctx.is_main:
        print(
            "[rlhf-hpc] the reward model's tokenizer differs from the actor's (vocabulary or chat template): each "
            "conversation is re-encoded through the reward model's chat template, as verl does by default "
            "(reward_model.model.input_tokenizer)",
            flush=True,
        )
    return RewardModel(
        model,
        rm,
        tokenizer=tokenizer if reencode else None,
        input_tokenizer=input_tokenizer if reencode else None,
        max_length=rm.max_length or cfg.data.max_prompt_length + cfg.data.max_response_length,
        sync_max=lambda k: all_reduce_max_int(k, ctx.device),
        device=ctx.device,
    )
