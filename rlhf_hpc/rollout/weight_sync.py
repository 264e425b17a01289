"""Training layout -> rollout engine: a streaming, bucketed, in-place weight reshard.

The FSDP2 actor holds a dim-0 shard of every parameter. ``stream_full_params`` yields each
parameter as a full tensor, in the rollout dtype, one bucket at a time: while the consumer (the
engine copying tensors into its own weights) works on bucket k, the all-gathers of bucket k+1 are
already in flight (async collectives), so communication overlaps the copy. At most two buckets of
gathered tensors exist at once, so the extra memory per rank stays near two buckets plus the
largest tensor, never a second copy of the model.

``sync_weights_to_rollout`` runs that stream into an engine's ``update_weights`` and reports time
and the engine's expectation checks.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from rlhf_hpc.distributed.comm import collective
from rlhf_hpc.models.lora import adapter_config, base_name, is_adapter, lora_scaling, merged_weights

__all__ = ["hf_name", "stream_full_params", "sync_weights_to_rollout"]

# wrappers that change parameter names but not the model (activation checkpointing, compile)
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def hf_name(name: str) -> str:
    """Training-model parameter name -> Hugging Face checkpoint name (what engines load)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _shard_info(p: torch.Tensor):
    """(local tensor on the mesh's device, process group of the sharded mesh dim or None, full
    dim-0 size). With parameter offload the shard lives on the host while the mesh (and NCCL)
    is on the GPU: the shard is copied over first, which is also where the engine wants it."""
    if not isinstance(p, DTensor):
        return p, None, p.shape[0] if p.dim() else None
    local = p.to_local()
    if p.device_mesh.device_type == "cuda" and local.device.type != "cuda":
        local = local.to(torch.device("cuda", torch.cuda.current_device()), non_blocking=True)
    dims = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard)]
    if not dims:
        return local, None, p.shape[0]
    if len(dims) > 1 or p.placements[dims[0]].dim != 0:
        raise ValueError(f"only dim-0 sharding is supported, got {p.placements}")
    return local, p.device_mesh.get_group(dims[0]), p.shape[0]


def _buckets(params: list[tuple[str, torch.Tensor]], dtype: torch.dtype, bucket_bytes: int):
    """Consecutive parameters grouped so that each bucket's full tensors fit ``bucket_bytes``;
    a tensor larger than a bucket forms a bucket of its own."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    bucket, size = [], 0
    for name, p in params:
        nbytes = p.numel() * itemsize
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, p))
        size += nbytes
    if bucket:
        yield bucket


def _launch(bucket, dtype: torch.dtype, piece_bytes: int, into_tensor: Optional[bool] = None):
    """Start the all-gathers of one bucket; returns handles to finish later.

    Each full tensor is gathered straight into its final buffer. On NCCL (``into_tensor``, the
    default for CUDA tensors) one ``all_gather_into_tensor`` per tensor writes the ranks' shards
    into it in place: its layout (rank r's rows at r x chunk) is the buffer's. Elsewhere the list
    form runs in row pieces of at most ``piece_bytes``: a backend that stages its output (gloo
    does) then needs only one piece of scratch memory, not a second copy of the whole tensor.
    """
    pending = []
    for name, p in bucket:
        local, group, dim0 = _shard_info(p)
        local = local.detach().to(dtype)  # cast before the gather: half the traffic for bf16
        if group is None:
            pending.append((name, p.shape, [], [local], dim0))
            continue
        n = dist.get_world_size(group)
        chunk = -(-dim0 // n)  # FSDP2 shards dim 0 like torch.chunk: ceil-sized, last ones short
        if local.shape[0] < chunk:  # all_gather needs equal sizes: pad, trim after
            pad = local.new_zeros((chunk - local.shape[0], *local.shape[1:]))
            local = torch.cat([local, pad])
        full = local.new_empty((n * chunk, *local.shape[1:]))
        if into_tensor if into_tensor is not None else local.is_cuda:
            pending.append(
                (
                    name,
                    p.shape,
                    [dist.all_gather_into_tensor(full, local.contiguous(), group=group, async_op=True)],
                    [full],
                    dim0,
                )
            )
            continue
        row_bytes = max(1, local[0].numel() * local.element_size()) if chunk else 1
        rows = max(1, piece_bytes // (n * row_bytes))
        works = []
        for a in range(0, chunk, rows):
            b = min(a + rows, chunk)
            outs = [full[r * chunk + a : r * chunk + b] for r in range(n)]
            piece = local[a:b].contiguous()
            with collective():
                works.append(dist.all_gather(outs, piece, group=group, async_op=True))
        pending.append((name, p.shape, works, [full], dim0))
    return pending


def stream_full_params(
    model: nn.Module,
    dtype: torch.dtype,
    bucket_mb: float,
    name_map: Callable[[str], str] = hf_name,
    into_tensor: Optional[bool] = None,
    include: Optional[Callable[[str], bool]] = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective generator (every rank iterates it fully, in step): ``(name, full tensor)`` for
    each parameter of ``model``, cast to ``dtype``, gathered ``bucket_mb`` MiB at a time with the
    next bucket's all-gathers in flight while this one is consumed. ``into_tensor``: the
    all_gather_into_tensor path (None: on CUDA tensors, i.e. NCCL). Every rank of a tensor-parallel
    rollout group receives full tensors and vLLM slices its part: simple, at the price of
    gathering what it then drops (BENCHMARKS.md). ``include``: only the parameters whose name it
    accepts (the same on every rank)."""
    params = [(n, p) for n, p in model.named_parameters() if include is None or include(n)]
    bucket_bytes = int(bucket_mb * 2**20)
    buckets = list(_buckets(params, dtype, bucket_bytes))
    if not buckets:
        return
    pending = _launch(buckets[0], dtype, bucket_bytes, into_tensor)
    for k in range(len(buckets)):
        current = pending
        pending = _launch(buckets[k + 1], dtype, bucket_bytes, into_tensor) if k + 1 < len(buckets) else []
        for name, shape, works, outs, dim0 in current:
            with collective(calls=0):  # the rank waits here for what is not yet gathered
                for work in works:
                    work.wait()
            full = outs.pop()[:dim0].reshape(shape)  # the bucket list no longer holds it
            yield name_map(name), full
            del full


def sync_weights_to_rollout(
    model: nn.Module,
    engine,
    dtype: torch.dtype,
    bucket_mb: float,
    name_map: Callable[[str], str] = hf_name,
    transform: Optional[Callable] = None,
    adapter_only: bool = True,
) -> dict[str, float]:
    """Stream the actor's weights into ``engine`` in place. Returns ``timing_s/update_weights`` and
    ``rollout/weight_sync_mib`` (what the engine received). ``transform``: the fault seam's
    (rlhf_hpc.ppo.faults, ``wrong_weights``) wrapper of the stream.

    A LoRA actor (a PEFT model): an engine that serves adapters (``engine.adapter_rank``, vLLM's
    LoRA) gets the base weights once (again only where it discarded them) and then the adapter
    alone, megabytes per step; any other engine, or ``adapter_only=False``, gets the merged
    W + (alpha / r) B A under the base names, every tensor every step."""
    t0 = time.perf_counter()
    lora, sent = hasattr(model, "peft_config"), [0]

    def feed(stream):
        for name, tensor in transform(stream) if transform is not None else stream:
            sent[0] += tensor.numel() * tensor.element_size()
            yield name, tensor

    if lora and adapter_only and engine.adapter_rank:
        if engine.needs_base_weights():
            engine.update_base_weights(
                feed(
                    (base_name(n), t)
                    for n, t in stream_full_params(
                        model, dtype, bucket_mb, name_map, include=lambda n: not is_adapter(n)
                    )
                )
            )
        engine.update_adapter(
            feed(stream_full_params(model, dtype, bucket_mb, name_map, include=is_adapter)), adapter_config(model)
        )
    else:
        stream = stream_full_params(model, dtype, bucket_mb, name_map)
        if lora:  # the engine gets W + (alpha / r) B A under the base names
            stream = merged_weights(stream, lora_scaling(model))
        engine.update_weights(feed(stream))
    if dist.is_initialized():
        with collective():
            dist.barrier()
    return {"timing_s/update_weights": time.perf_counter() - t0, "rollout/weight_sync_mib": sent[0] / 2**20}
