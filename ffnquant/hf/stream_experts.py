"""The engine's routed experts read a layer at a time (`hf.stream.SequentialModel`): which experts tensors the
checkpoint does not hold as the module does (`experts_made`: Mixtral's, per expert on disk, fused by transformers as it
loads), and those filled from each expert's FFN as `hf.checkpoint` reads it (`fill_experts`)."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from ..errors import FFNQuantError
from .checkpoint import ModelInfo

__all__ = ["experts_made", "fill_experts"]


def experts_made(model: nn.Module, info: ModelInfo, found: Mapping[Any, tuple[str, nn.Module]], weights: Any,
                  stored: Mapping[str, str]) -> dict[str, tuple[str, int]]:
    """The routed experts' tensors of `model` that the checkpoint does not hold as the module does (Mixtral's:
    per expert on disk, fused by transformers as it loads): {parameter name: (its experts module's name, layer)}.
    A tensor stored as it is held (gpt-oss', JetMoE's) is read by name like any other."""
    from .routed import expert_tensors

    out: dict[str, tuple[str, int]] = {}
    for layer, (module_name, module) in found.items():
        if layer.expert is None:
            continue
        for tensor in expert_tensors(module, info.arch).values():
            for name in (tensor, f"{tensor}_bias"):
                try:
                    p = module.get_parameter(name)
                except AttributeError:
                    continue
                full = f"{module_name}.{name}"
                key = stored.get(full, full)
                if key not in weights.file_of or tuple(weights.shape(key)) != tuple(p.shape):
                    out[full] = (module_name, layer.index)
    return out


def fill_experts(module: nn.Module, info: ModelInfo, j: int, weights: Any = None) -> None:
    """Layer j's experts module's tensors (zeros, in the engine's dtype) filled with each expert's FFN as
    `hf.checkpoint` reads it from the shards (through `weights`, its `ffn_reader`), one expert at a time, through
    the module's own layout (`hf.routed.expert_weight`, `expert_bias`)."""
    from .checkpoint import iter_ffn_layers
    from .routed import expert_bias, expert_weight

    with torch.no_grad():
        for layer in iter_ffn_layers(info, [j], weights=weights):
            for weight in layer.spec.weight_names:
                lin = getattr(layer.ffn, weight)
                view = expert_weight(module, layer.expert, weight, info.arch)
                view.copy_(lin.weight.to(view.dtype))
                if lin.bias is not None:
                    bias = expert_bias(module, layer.expert, weight, info.arch)
                    if bias is not None:
                        bias.copy_(lin.bias.to(bias.dtype))
                    elif bool(lin.bias.any()):
                        raise FFNQuantError(f"{info.path}: L{j}'s experts module holds no bias of {weight}, which "
                                            "its checkpoint stores: reading a layer at a time cannot place it; run it "
                                            "whole (--no-sequential)")
