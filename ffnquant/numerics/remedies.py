"""Outlier remedies that move or spread activation range without changing the float function.

- `smooth` (SmoothQuant, Xiao et al. 2022): per-channel scales s = max|X_j|^a / max|W_j|^(1-a)
  that divide an activation channel and multiply the consuming weight's input column.
  For `hidden` (the down projection's input) the 1/s is folded into what produces the
  channel: gated variants into the value branch `w_up`'s output rows (hidden = act(gate) *
  up is linear in up: the Smooth-SwiGLU fold, exact); ReLU into `w_up` rows and bias (exact,
  relu(z/s) = relu(z)/s for s > 0). GELU/Swish dense are not positively homogeneous, so the
  fold would change the function: refused. For `input` the 1/s is an explicit multiply in
  `model.input_transform` (to be folded into the preceding norm's gain in a full model).
- `rotate` (QuaRot-style): an orthogonal block-Hadamard Q on `hidden` in
  `model.hidden_transform`, with W_down <- W_down Q, so hidden Q (W_down Q)^T = hidden W_down^T.

Both return a NEW model (deep copy) and a `RemedyRecord` saying what was done.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from ..errors import FFNQuantError, unknown_choice
from ..model import FFN
from ..spec import Activation

__all__ = [
    "SMOOTH_SITES",
    "ChannelScale",
    "BlockHadamard",
    "RemedyRecord",
    "smooth_exact_for",
    "smooth_scales",
    "smooth",
    "hadamard",
    "hadamard_block_size",
    "rotate",
]

SMOOTH_SITES = ("input", "hidden")
# Activations with f(z / s) = f(z) / s for every s > 0 (positive homogeneity): the dense fold is exact.
_HOMOGENEOUS = frozenset({Activation.RELU, Activation.IDENTITY})


class ChannelScale(nn.Module):
    """x * scale per channel (last axis): the explicit form of a fold into the preceding norm."""

    def __init__(self, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("scale", scale.detach().clone().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d)
        return x * self.scale.to(x.dtype)


class BlockHadamard(nn.Module):
    """x -> x Q with Q = blockdiag(H_b, ..., H_b) / sqrt(b), H_b the Sylvester Hadamard matrix (symmetric, orthogonal)."""

    def __init__(self, features: int, block: int) -> None:
        super().__init__()
        if features % block:
            raise FFNQuantError(f"Hadamard block {block} does not divide {features}")
        self.features, self.block = features, block
        self.register_buffer("h", hadamard(block) / math.sqrt(block))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., f)
        shape = x.shape
        xb = x.reshape(*shape[:-1], self.features // self.block, self.block)  # (..., f/b, b)
        return torch.matmul(xb, self.h.to(x.dtype)).reshape(shape)

    def matrix(self) -> torch.Tensor:
        """The full [f, f] orthogonal Q."""
        return torch.block_diag(*([self.h] * (self.features // self.block)))

    def extra_repr(self) -> str:
        return f"features={self.features}, block={self.block}"


@dataclass
class RemedyRecord:
    """What a remedy did: its kind, parameters, and per-site details (scales for folding, block sizes)."""

    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    exact: bool = True
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "params": self.params, "details": self.details, "exact": self.exact, "note": self.note}


def smooth_exact_for(model: FFN) -> dict[str, bool]:
    """Which sites `smooth` can fold exactly for this model (input always; hidden for gated and ReLU-like)."""
    spec = model.spec
    return {"input": True, "hidden": spec.gated or spec.activation in _HOMOGENEOUS}


def smooth_scales(act_absmax: np.ndarray | torch.Tensor, weight_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's s_j = max|X_j|^alpha / max|W_j|^(1-alpha), with zero channels left at 1."""
    w = weight_absmax.detach().double()
    # the activation statistics are host-side (numpy); the scales go where the weights are
    a = torch.as_tensor(np.asarray(act_absmax, dtype=np.float64)).double().to(w.device)
    s = a.clamp_min(1e-12).pow(alpha) / w.clamp_min(1e-12).pow(1.0 - alpha)
    dead = (a <= 0) | (w <= 0) | ~torch.isfinite(s)
    return torch.where(dead, torch.ones_like(s), s).float()


def _channel_absmax(table: Any, site: str, features: int) -> np.ndarray:
    try:
        obs = table[site]
    except (KeyError, FFNQuantError):
        raise FFNQuantError(f"smooth needs the range of site {site!r}; profile it first") from None
    cam = np.asarray(obs.channel_absmax, dtype=np.float64)
    if cam.shape != (features,):
        raise FFNQuantError(f"range table site {site!r} has {cam.shape} channels, the model {features}")
    return cam


def smooth(model: FFN, table: Any, alpha: float = 0.5, sites: Sequence[str] = SMOOTH_SITES) -> tuple[FFN, RemedyRecord]:
    """SmoothQuant fold at `sites` (input and/or hidden) with strength `alpha`; `table` is the model's RangeTable."""
    if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
        raise FFNQuantError(f"smooth alpha must be in [0, 1], got {alpha!r}")
    sites = list(dict.fromkeys(sites))
    for s in sites:
        if s not in SMOOTH_SITES:
            raise unknown_choice("smooth site", s, SMOOTH_SITES)
    spec = model.spec
    exact = smooth_exact_for(model)
    if "hidden" in sites and not exact["hidden"]:
        raise FFNQuantError(
            f"smooth cannot fold the hidden scale of {spec.variant.value} exactly: {spec.activation.value}(z/s) != "
            f"{spec.activation.value}(z)/s; smooth only the input (sites=('input',)) or rotate the hidden"
        )
    new = copy.deepcopy(model)
    record = RemedyRecord("smooth", {"alpha": float(alpha), "sites": sites})
    with torch.no_grad():
        if "input" in sites:
            consumers = [new.w_up] + ([new.w_gate] if new.w_gate is not None else [])
            w_absmax = torch.stack([lin.weight.abs().amax(dim=0) for lin in consumers]).amax(dim=0)  # [d]
            x_absmax = _channel_absmax(table, "input", spec.d_model)
            s = smooth_scales(x_absmax, w_absmax, alpha)
            if isinstance(model.input_transform, ChannelScale):  # smoothing twice composes
                prior = model.input_transform.scale
            else:
                prior = torch.ones_like(s)
            new.input_transform = ChannelScale(prior / s)
            for lin in consumers:
                lin.weight.mul_(s[None, :])
            record.details["input"] = {
                "fold": "x * (1/s) before the input tap (fold into the preceding norm's gain); s into w_up"
                + ("/w_gate" if new.w_gate is not None else "") + " columns",
                "scale_min": float(s.min()),
                "scale_max": float(s.max()),
                "input_scale_to_fold_into_norm": (prior / s).tolist(),
            }
        if "hidden" in sites:
            w_absmax = new.w_down.weight.abs().amax(dim=0)  # [f]
            h_absmax = _channel_absmax(table, "hidden", spec.d_ff)
            if not isinstance(model.hidden_transform, nn.Identity):
                raise FFNQuantError("smooth the hidden before rotating it (the rotation mixes channels)")
            s = smooth_scales(h_absmax, w_absmax, alpha)
            new.w_up.weight.div_(s[:, None])
            if new.w_up.bias is not None:
                new.w_up.bias.div_(s)
            new.w_down.weight.mul_(s[None, :])
            why = "linear value branch (Smooth-SwiGLU fold)" if spec.gated else "relu is positively homogeneous"
            record.details["hidden"] = {
                "fold": "1/s into w_up output rows" + (" and bias" if new.w_up.bias is not None else "")
                + f" ({why}); s into w_down input columns",
                "scale_min": float(s.min()),
                "scale_max": float(s.max()),
            }
    return new.eval(), record


def hadamard(n: int) -> torch.Tensor:
    """The Sylvester Hadamard matrix of order n (a power of two), entries +-1, float32."""
    if n < 1 or n & (n - 1):
        raise FFNQuantError(f"Sylvester Hadamard order must be a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_block_size(d_ff: int, max_block: int | None = None) -> int:
    """The largest power of two dividing d_ff (at most `max_block`): 1408 -> 128, 11008 -> 256, 14336 -> 2048."""
    b = d_ff & -d_ff
    if max_block is not None:
        while b > max_block:
            b //= 2
    return b


def rotate(model: FFN, max_block: int | None = 256) -> tuple[FFN, RemedyRecord]:
    """Block-Hadamard rotation of `hidden` (in `hidden_transform`) with W_down <- W_down Q; exact in float.

    Blocks are capped at `max_block` (default 256) because the rotation runs as a dense
    [b, b] matmul per block: its cost is d_ff * b per token against 3 d_model d_ff for the FFN.
    """
    d_ff = model.spec.d_ff
    block = hadamard_block_size(d_ff, max_block)
    if block < 2:
        raise FFNQuantError(f"rotate needs an even d_ff (a power-of-two Hadamard block); d_ff={d_ff} is odd")
    if not isinstance(model.hidden_transform, nn.Identity):
        raise FFNQuantError("the hidden is already transformed (rotated twice?)")
    new = copy.deepcopy(model)
    rot = BlockHadamard(d_ff, block).to(model.w_down.weight.device)  # where the model computes
    new.hidden_transform = rot
    with torch.no_grad():
        w = new.w_down.weight  # [d, f]
        wb = w.reshape(w.shape[0], d_ff // block, block)
        w.copy_(torch.matmul(wb, rot.h).reshape(w.shape))  # W Q, block by block
    note = f"block-diagonal Hadamard, {d_ff // block} blocks of {block} (largest power of two dividing d_ff={d_ff})"
    if block < 32:
        note += "; small blocks spread outliers over few channels only"
    record = RemedyRecord("rotate", {"block": block, "max_block": max_block}, {"hidden": {"blocks": d_ff // block, "block": block}}, note=note)
    return new.eval(), record
