"""The one place that applies FSDP2 to a model: sharding groups, mixed precision, offload,
prefetch and activation checkpointing."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from rlhf_hpc.config import FSDPConfig
from rlhf_hpc.models import torch_dtype
from rlhf_hpc.profiling import time_fsdp_collectives


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, found by the class names transformers lists as unsplittable."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (looked for {sorted(names)})")
    return layers


def _tied(model: nn.Module) -> bool:
    emb, out = model.get_input_embeddings(), model.get_output_embeddings()
    return out is not None and out.weight is emb.weight


def parallelize(model: nn.Module, mesh: DeviceMesh, fsdp: FSDPConfig, device: torch.device,
                gradient_checkpointing: bool = False) -> nn.Module:
    """Shard ``model`` in place over ``mesh`` (1-D: FULL_SHARD; 2-D (replicate, shard): HSDP).

    Groups: each decoder layer, the input embedding and the output head (each on its own, so that
    streaming the weights out never holds more than one of them unsharded), then the root
    (final norm, value head). A tied embedding/head stays in the root group: two groups cannot
    own one parameter.
    """
    if gradient_checkpointing:
        # transformers' own checkpointing: no wrapper modules, so parameter names stay the same
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=torch_dtype(fsdp.mixed_precision.param_dtype),
                              reduce_dtype=torch_dtype(fsdp.mixed_precision.reduce_dtype))
    offload: OffloadPolicy = OffloadPolicy()
    if fsdp.param_offload or fsdp.offload_policy:
        # pinned host memory only helps (and only works) with an accelerator
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    # null (not chosen by rlhf_hpc.layout, e.g. a reward model): free after forward, no prefetch
    reshard = True if fsdp.reshard_after_forward is None else fsdp.reshard_after_forward
    kw = dict(mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, **kw)
    if not _tied(model):
        fully_shard(model.get_input_embeddings(), **kw)
        out = model.get_output_embeddings()
        if out is not None:
            fully_shard(out, **kw)
    fully_shard(model, **kw)
    time_fsdp_collectives(model, hsdp=mesh.ndim == 2)  # FSDP2's collectives count in perf/comm_fraction
    if fsdp.forward_prefetch:
        # issue the next layer's all-gather while this layer computes (and the mirror in backward)
        for prev, nxt in zip(layers, layers[1:]):
            prev.set_modules_to_forward_prefetch([nxt])
            nxt.set_modules_to_backward_prefetch([prev])
    return model
