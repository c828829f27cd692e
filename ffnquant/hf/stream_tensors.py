"""The engine's tensor helpers (`hf.stream`): host and device moves, a checkpoint tensor read in row chunks, an
FFN's parameters rounded to a runtime's dtype, nested values in float32."""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch
from torch import nn

from ..errors import FFNQuantError
from ..infra.device import to_device
from .checkpoint import _Weights
from .memory import _READ_BYTES

__all__: list[str] = []  # private helpers of hf.stream and its planners

_CPU = torch.device("cpu")



def _host(value: Any) -> Any:
    """`value`'s tensors in host memory (itself on the CPU)."""
    return to_device(value, _CPU)


def _on(ffn: Any, device: torch.device) -> Any:
    """A replacement FFN (a module) on `device`, to compute where the engine does."""
    return ffn.to(device) if isinstance(ffn, nn.Module) and device.type != "cpu" else ffn


def _read(weights: _Weights, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Tensor `name` of the safetensors shards in `dtype`: `weights.get(name).to(dtype)`, value for value."""
    from safetensors import safe_open

    shape = weights.shape(name)
    numel = math.prod(shape)
    if not shape or numel * 4 <= 2 * _READ_BYTES:
        return weights.get(name).to(dtype)
    path = weights.file_of[name]
    out = torch.empty(shape, dtype=dtype)
    step = max(1, _READ_BYTES // (2 * (numel // shape[0])))  # rows of <= _READ_BYTES in 16-bit dtypes
    try:
        for i in range(0, shape[0], step):
            with safe_open(str(path), framework="pt") as fh:  # opened per chunk: its mapped pages go with it
                out[i:i + step].copy_(fh.get_slice(name)[i:i + step])
    except Exception as exc:
        raise FFNQuantError(f"cannot read tensor {name!r} from {str(path)!r}: {exc}") from exc
    return out


def _rounded(layer: Any, dtype: torch.dtype) -> Any:
    """An HFLayer whose FFN holds its parameters rounded to `dtype` (as float32 values): what a model loaded in
    `dtype` computes with, when the checkpoint is stored more precisely."""
    ffn = copy.deepcopy(layer.ffn)
    with torch.no_grad():
        for p in ffn.parameters():
            p.copy_(p.to(dtype).float())
    return dataclasses.replace(layer, ffn=ffn)


def _float32(value: Any) -> Any:
    """`value` (a tensor, or tuples, lists and dicts of them) with its floating tensors in float32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_float32(v) for v in value)
    if isinstance(value, dict):
        return {k: _float32(v) for k, v in value.items()}
    return value
