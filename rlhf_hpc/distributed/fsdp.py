"""The one place that applies FSDP2 to a model: sharding groups, mixed precision, offload,
prefetch and activation checkpointing; and, for a model replicated on the host, the same without
FSDP2 (mixed precision by casting hooks, gradients averaged by ``ReplicaGradients``)."""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from rlhf_hpc.config.schema import FSDPConfig
from rlhf_hpc.distributed.comm import collective, time_fsdp_collectives
from rlhf_hpc.distributed.host_allreduce import SharedMemoryAllReduce
from rlhf_hpc.models.hf import torch_dtype

__all__ = [
    "ReplicaGradients",
    "compute_in_dtype",
    "decoder_layers",
    "describe_gradient_reduction",
    "finish_gradient_sync",
    "gradient_reduction",
    "host_replicas",
    "parallelize",
    "set_gradient_sync",
    "tied_embeddings",
]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, found by the class names transformers lists as unsplittable."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (looked for {sorted(names)})")
    return layers


def tied_embeddings(model: nn.Module) -> bool:
    emb, out = model.get_input_embeddings(), model.get_output_embeddings()
    return out is not None and out.weight is emb.weight


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    fsdp: FSDPConfig,
    device: torch.device,
    gradient_checkpointing: bool = False,
    shared_memory: bool = True,
) -> nn.Module:
    """Shard ``model`` in place over ``mesh`` (1-D: FULL_SHARD; 2-D (replicate, shard): HSDP).
    A model replicated on the host (``host_replicas``) is left whole instead: its modules compute in
    ``param_dtype`` (``compute_in_dtype``) and ``ReplicaGradients`` averages its gradients.

    Groups: each decoder layer, the input embedding and the output head (each on its own, so that
    streaming the weights out never holds more than one of them unsharded), then the root
    (final norm, value head). A tied embedding/head stays in the root group: two groups cannot
    own one parameter.

    ``shared_memory``: a model replicated on the host (``host_replicas``) may average its gradients
    through shared memory when all ranks run on this machine; False keeps gloo (for comparisons).
    """
    if gradient_checkpointing:
        # transformers' own checkpointing: no wrapper modules, so parameter names stay the same
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(
        param_dtype=torch_dtype(fsdp.mixed_precision.param_dtype),
        reduce_dtype=torch_dtype(fsdp.mixed_precision.reduce_dtype),
    )
    offload: OffloadPolicy = OffloadPolicy()
    if fsdp.param_offload or fsdp.offload_policy:
        # pinned host memory only helps (and only works) with an accelerator
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    replicas = host_replicas(mesh, fsdp, device) if any(p.requires_grad for p in model.parameters()) else None
    if replicas is not None:
        compute_in_dtype(model, mp.param_dtype)
        _REPLICA_GRADIENTS[model] = ReplicaGradients(model, replicas, shared_memory)
        return model
    # null (not chosen by rlhf_hpc.planning.layout, e.g. a reward model): free after forward, no prefetch
    reshard = True if fsdp.reshard_after_forward is None else fsdp.reshard_after_forward
    kw = dict(mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, **kw)
    if not tied_embeddings(model):
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


# ------------------------------------------------------------------------------ replicated on the host
def compute_in_dtype(model: nn.Module, dtype: Optional[torch.dtype]) -> None:
    """FSDP2's mixed precision (``param_dtype``) for a model that each rank holds whole, without
    FSDP2: a module casts its own parameters to ``dtype`` when called and puts them back when it
    returns. The cast is part of the graph, so the backward computes in ``dtype`` and the gradients
    arrive cast back into the parameters' own dtype (fp32), accumulated there across micro-batches,
    as FSDP2's reduce-dtype copy does. The parameters, their names and the state dict stay as they
    are. Floating positional inputs are cast to ``dtype`` too (FSDP2 casts forward inputs). Re-entrant:
    activation checkpointing's recompute calls the module again and casts again."""
    if dtype is None:
        return
    for module in model.modules():
        names = [
            n for n, p in module._parameters.items() if p is not None and p.is_floating_point() and p.dtype != dtype
        ]
        if not names:
            continue
        kept: list[dict] = []  # the parameters while the module runs (a stack: calls may nest)

        def cast(module, args, names=names, kept=kept):
            kept.append({n: module._parameters[n] for n in names})
            for n in names:
                module._parameters[n] = kept[-1][n].to(dtype)
            # floating inputs too, as FSDP2's cast_forward_inputs: a caller may have matched them to the
            # parameters' own dtype before the call (PEFT casts x to lora_A.weight.dtype, fp32 here)
            if any(isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != dtype for a in args):
                return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
            return None

        def restore(module, args, output, kept=kept):
            module._parameters.update(kept.pop())

        module.register_forward_pre_hook(cast)
        module.register_forward_hook(restore, always_call=True)  # also when the forward raises


def host_replicas(mesh: DeviceMesh, fsdp: FSDPConfig, device: torch.device):
    """The replicate group when every rank holds the whole model on the host (a (replicate, 1) mesh
    on CPU, kept whole between forward and backward, no prefetch) and the gradients are reduced in
    their own dtype, else None (FSDP2 does it all). Only models that train ask (a frozen one keeps
    the mesh: with one rank per shard group its forward communicates nothing either way).

    Such a model is not given to FSDP2 at all (``parallelize``): on a one-rank shard group FSDP2
    has nothing to shard, yet per layer group and micro-batch it still copies the weights into an
    all-gather buffer, and each gradient into a reduce buffer and out again (about 0.3 s of the
    issue-19 step); on gloo its HSDP all-reduce also runs synchronously inside the backward, once per
    layer group, waiting for the slower rank at each. ``reshard_after_forward=true`` or
    ``forward_prefetch=true`` set in the recipe keep FSDP2, which does what they ask. On GPUs FSDP2's
    all-reduces already run on their own stream."""
    if device.type != "cpu" or mesh.ndim != 2 or mesh["shard"].size() != 1 or mesh["replicate"].size() == 1:
        return None
    if fsdp.param_offload or fsdp.offload_policy:
        return None
    if fsdp.reshard_after_forward is True or fsdp.forward_prefetch:
        return None
    if torch_dtype(fsdp.mixed_precision.reduce_dtype) != torch_dtype(fsdp.model_dtype):
        return None  # FSDP2 reduces in reduce_dtype; here the gradients are reduced as they are kept
    return mesh["replicate"].get_group()


class ReplicaGradients:
    """DDP's gradient averaging for a model each rank holds whole, without FSDP2 (``host_replicas``).

    Ranks all on this machine average the gradients through shared memory
    (``rlhf_hpc.distributed.host_allreduce``) when the update asks for them (``finish``): one pass over the
    gradient in each rank's own thread, nothing competing with the backward for the cores.
    Otherwise (ranks on several hosts, no usable ``/dev/shm``): autograd accumulates each
    parameter's gradient when the backward is done with it and then runs the parameter's
    post-accumulate-grad hooks; the hook here starts an asynchronous gloo all-reduce of it
    (pre-divided by the replicas: their mean, as FSDP2 computes), and ``finish`` waits for them.
    Either way only the gradients of a backward run with ``enabled`` are averaged: the update turns
    it on for the last micro-batch of a mini-batch, the others accumulate locally (as FSDP2's
    ``set_requires_all_reduce(False)``)."""

    def __init__(self, model: nn.Module, group, shared_memory: bool = True):
        self.group, self.size = group, dist.get_world_size(group)
        self.enabled = True
        self.pending: list = []
        self.ready = False  # a backward with ``enabled`` ran since the last average (shared memory)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.shared, why = (
            SharedMemoryAllReduce.create(group) if shared_memory else (None, "parallelize(shared_memory=False)")
        )
        self.how = "shared memory" if self.shared is not None else "gloo"
        self.why = why  # for the log: the mapping's size, or why gloo
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, param: torch.Tensor) -> None:
        if not self.enabled:
            return
        if self.shared is not None:
            self.ready = True
            return
        param.grad.div_(self.size)
        self.pending.append(dist.all_reduce(param.grad, group=self.group, async_op=True))

    def finish(self) -> None:
        if self.shared is not None:
            if self.ready:
                with collective(calls=1), torch.profiler.record_function("ReplicaGradients.shared_memory_mean"):
                    self.shared.mean_([p.grad for p in self.params if p.grad is not None])
                self.ready = False
            return
        with collective(calls=len(self.pending)):  # the time the rank waits for them
            for work in self.pending:
                work.wait()
        self.pending.clear()


_REPLICA_GRADIENTS: "weakref.WeakKeyDictionary[nn.Module, ReplicaGradients]" = weakref.WeakKeyDictionary()


def set_gradient_sync(model: nn.Module, on: bool) -> None:
    """Whether the next backward averages the gradients across the replicas (off: they accumulate
    locally, for all but the last micro-batch of a mini-batch). FSDP2's HSDP: its all-reduce (the
    reduce-scatter inside a shard group runs every time, so no memory is added)."""
    replicas = _REPLICA_GRADIENTS.get(model)
    if replicas is not None:
        replicas.enabled = on
    elif hasattr(model, "set_requires_all_reduce"):
        model.set_requires_all_reduce(on, recurse=True)


def gradient_reduction(model: nn.Module) -> str:
    """How ``model``'s gradients are averaged across replicas: "host replicas, shared memory" or
    "host replicas, gloo" (``ReplicaGradients``), or "fsdp2" (FSDP2's own reduce-scatter / HSDP
    all-reduce, or nothing to reduce)."""
    replicas = _REPLICA_GRADIENTS.get(model)
    return "fsdp2" if replicas is None else f"host replicas, {replicas.how}"


def describe_gradient_reduction(model: nn.Module) -> Optional[str]:
    """A line for the run's log on how a replicated host model averages its gradients, else None."""
    replicas = _REPLICA_GRADIENTS.get(model)
    if replicas is None:
        return None
    if replicas.shared is not None:
        return f"gradients averaged across the {replicas.size} replicas through {replicas.why}"
    return f"gradients averaged across the {replicas.size} replicas by asynchronous gloo all-reduces ({replicas.why})"


def finish_gradient_sync(model: nn.Module) -> None:
    """Wait for the gradient reductions still running (host replicas); a no-op for FSDP2's own."""
    replicas = _REPLICA_GRADIENTS.get(model)
    if replicas is not None:
        replicas.finish()
