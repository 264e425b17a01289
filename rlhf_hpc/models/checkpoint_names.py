"""The training model's tensors under the checkpoint's names and layout, for engines that load the hub's format.

transformers 5 fuses some architectures' weights while loading (``transformers.conversion_mapping``):
a mixture of experts holds each layer's experts as two 3-D tensors, ``mlp.experts.gate_up_proj``
(E, 2I, H) and ``mlp.experts.down_proj`` (E, H, I), where the hub's files (and vLLM's loaders) name
each expert's matrices (``mlp.experts.{e}.gate_proj.weight`` ...; Mixtral:
``block_sparse_moe.experts.{e}.w1.weight`` ...). ``save_pretrained`` reverts that conversion for a
whole state dict; the weight sync streams one tensor at a time, so each tensor is reverted alone
(every reverse conversion here splits one fused tensor into views, it never joins several).
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn

__all__ = ["checkpoint_names"]

Stream = Iterable[tuple[str, torch.Tensor]]


def checkpoint_names(model: nn.Module) -> Optional[Callable[[Stream], Iterator[tuple[str, torch.Tensor]]]]:
    """For a transformers ``model`` (a meta-device build is enough): None where its parameters are
    the checkpoint's tensors already (the dense models), else a function turning a stream of
    ``(parameter name, full tensor)`` into the checkpoint's ``(name, tensor)`` pairs."""
    try:  # (transformers 5: its loading-time conversions; 4.x loads the checkpoint's names unchanged)
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, revert_weight_conversion
    except ImportError:
        return None
    conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    if not conversions:
        return None

    def convert(stream: Stream) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in stream:
            yield from revert_weight_conversion(model, {name: tensor}).items()

    return convert
