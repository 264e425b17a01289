"""Pretrained weights read once per job, not once per rank.

Building the whole model on every rank from its checkpoint before sharding it would hold one full
copy per rank on the host at start-up (8 per node of the 7B flagship in fp32). Here global rank 0 alone reads
the checkpoint (``from_pretrained``: transformers' own key mapping, tying and conversions); every
other rank builds the same structure on the meta device (no memory). Then, as in the reference
system (verl's ``fsdp2_load_full_state_dict``):

- sharded models (FSDP2): every rank shards its model, the meta ranks materialize only their own
  shards, and each full tensor is broadcast from rank 0 while every rank keeps its slice
  (``broadcast_into_shards``: what ``set_model_state_dict(..., broadcast_from_rank0=True)`` does,
  but always on the job's device); buffers (rotary tables, embedding scales: computed at
  construction, never in a checkpoint) are broadcast too;
- models replicated on the host (small models, ``parallel.host_replicas``): every rank needs the
  whole model anyway; rank 0's tensors are broadcast into the others' before the model is wrapped.

Host memory at start-up, per node: one full copy (rank 0's node) plus each rank's shard, instead of
one full copy per rank (BENCHMARKS.md: "Host memory at start-up"). Random-weight tiny models are
built from a seed on every rank, as before: nothing is read.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from rlhf_hpc.distributed.fsdp import host_replicas, parallelize
from rlhf_hpc.distributed.process_group import build_train_mesh

__all__ = ["broadcast_into_shards", "build_once", "build_sharded", "materialize"]


def build_sharded(
    build: Callable[[str], nn.Module],
    fsdp,
    ctx,
    gradient_checkpointing: bool,
    from_checkpoint: bool,
    frozen: bool = False,
) -> nn.Module:
    """``build(device)`` (``"cpu"`` or ``"meta"``) sharded over its training mesh (``fsdp``: a
    ``FSDPConfig`` with its layout filled in, rlhf_hpc.planning.layout; ``ctx``: the ``DistContext``), a
    checkpoint on disk read by rank 0 only. ``frozen``: no gradients (reference, reward model)."""
    mesh = build_train_mesh(ctx.device, ctx.world_size, fsdp.fsdp_size)

    def built(device: str) -> nn.Module:
        model = build(device)
        return model.requires_grad_(False) if frozen else model

    def shard(model: nn.Module) -> nn.Module:
        return parallelize(model, mesh, fsdp, ctx.device, gradient_checkpointing=gradient_checkpointing)

    # (parallelize keeps a model whole on every rank only where it trains)
    replicated = not frozen and host_replicas(mesh, fsdp, ctx.device) is not None
    return build_once(built, shard, replicated, ctx.device, from_checkpoint)


def build_once(
    build: Callable[[str], nn.Module],
    shard: Callable[[nn.Module], nn.Module],
    replicated: bool,
    device: torch.device,
    from_checkpoint: bool,
) -> nn.Module:
    """The model ``build(device)`` makes (``"cpu"``: with its weights; ``"meta"``: the structure
    only), sharded by ``shard`` (``parallel.parallelize``), read from its checkpoint by rank 0 only.
    ``replicated``: ``shard`` keeps every rank's model whole (host replicas). ``from_checkpoint``
    False (a seeded random model) or a single process: every rank builds it itself. Collective."""
    if not from_checkpoint or not dist.is_initialized() or dist.get_world_size() == 1:
        return shard(build("cpu"))
    source = dist.get_rank() == 0
    model = build("cpu" if source else "meta")
    if replicated:
        if not source:
            materialize(model, torch.device("cpu"), init_buffers=False)
        _broadcast_tensors(model)
        return shard(model)
    full = model.state_dict() if source else {}  # rank 0 keeps the full tensors until they are sent
    shard(model)
    if not source:
        materialize(model, device, init_buffers=False)  # (buffers arrive from rank 0 below)
    broadcast_into_shards(model, full, device)
    del full
    for b in model.buffers():
        dist.broadcast(b, src=0)
    return model


def broadcast_into_shards(model: nn.Module, full: dict, device: torch.device) -> None:
    """Rank 0's full tensors (``full``, its state dict before sharding; ``{}`` on the other ranks)
    into every rank's FSDP2 shards of ``model``, one tensor at a time, broadcast on ``device``.

    torch's ``set_model_state_dict(broadcast_from_rank0=True)`` broadcasts on the device the shards
    live on. With ``param_offload`` on GPUs (FSDP2's CPUOffloadPolicy) that is the host: the process
    group's gloo backend would carry every full tensor over TCP (~15 GB for a 7B reference in fp16).
    Here the broadcast always runs on the job's device (NCCL on GPUs) and each rank copies its own
    slice to wherever its shard lives. Peak beyond the shards: one full tensor on ``device``. Collective."""
    source = dist.get_rank() == 0
    with torch.no_grad():
        for name, param in model.named_parameters():  # (a tied parameter once, under its first name)
            if source:
                tensor = full[name].detach().to(device=device, dtype=param.dtype).contiguous()
            else:
                tensor = torch.empty(param.shape, dtype=param.dtype, device=device)
            dist.broadcast(tensor, src=0)
            local = param.to_local() if isinstance(param, DTensor) else param
            part = _local_slice(tensor, param) if isinstance(param, DTensor) else tensor
            if part.shape != local.shape:
                raise RuntimeError(
                    f"{name}: this rank's slice {tuple(part.shape)} is not its shard {tuple(local.shape)}"
                )
            local.copy_(part)
            del tensor


def _local_slice(full: torch.Tensor, param: DTensor) -> torch.Tensor:
    """This rank's part of ``full`` under ``param``'s placements: DTensor's split (``torch.chunk``
    along a sharded dimension, an empty slice for a rank past the last chunk), mesh dimension by
    mesh dimension (FSDP2: ``Shard(0)``; HSDP: ``(Replicate(), Shard(0))``)."""
    part, mesh = full, param.device_mesh
    for mesh_dim, placement in enumerate(param.placements):
        if type(placement) is Replicate:
            continue
        if type(placement) is not Shard:
            raise NotImplementedError(f"loading into a {placement} placement")
        chunks = part.chunk(mesh.size(mesh_dim), dim=placement.dim)
        index = mesh.get_local_rank(mesh_dim)
        part = chunks[index] if index < len(chunks) else part.narrow(placement.dim, 0, 0)
    return part


def materialize(model: nn.Module, device: torch.device, init_buffers: bool = True) -> nn.Module:
    """Give a model built on the meta device real, uninitialized storage on ``device`` (the weights
    are filled in later: a broadcast, a checkpoint, the first weight sync). Buffers are computed
    again where ``init_buffers`` (transformers' own initialisation of the modules that hold them:
    rotary frequencies, embedding scales), and a tied head is tied again where ``to_empty`` gave
    each module its own tensor (FSDP2 keeps the tie itself)."""
    model.to_empty(device=device)
    if init_buffers:
        init = getattr(model, "_init_weights", None)
        with torch.no_grad():
            for module in model.modules():
                if init is not None and next(module.buffers(recurse=False), None) is not None:
                    init(module)
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if (
        out is not None
        and getattr(model.config, "tie_word_embeddings", False)
        and out.weight is not model.get_input_embeddings().weight
    ):
        model.tie_weights()
    return model


def _broadcast_tensors(model: nn.Module) -> None:
    """Rank 0's parameters and buffers into every rank's (same structure, each tensor once)."""
    seen, tensors = set(), []
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            tensors.append(t)
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src=0)
