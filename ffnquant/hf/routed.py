"""Routed experts held as 3-D tensors in one module, as transformers (>= 5) computes them: one expert's matrix
(`expert_weight`) and FFN (`expert_forward`) in any of its layouts (output- or input-major, biased, gate and up side
by side or interleaved, the module's own gate function); what a call of the module hands each expert, however the
MoE block passes it (`routed_rows`); and the module's forward with some experts replaced (`experts_forward`)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..errors import FFNQuantError
from .probe import takes_sorted_tokens

__all__ = ["expert_forward", "expert_weight", "experts_forward", "routed_rows"]


def expert_weight(module: nn.Module, expert: int, weight: str, arch: Any) -> torch.Tensor:
    """One routed expert's `weight` ("w_gate", "w_up", "w_down", [out, in]) as a view of the fused experts module's
    tensors, in the layout `arch` read them in (`hf.checkpoint`): gate_up_proj [E, 2f, d] or input-major [E, d, 2f]
    (`arch.transposed`), gate and up side by side (gate first) or alternating (`arch.interleaved`); without a gate,
    up_proj; down_proj [E, d, f] or [E, f, d]. A view: writing into it writes the module's tensor."""
    view = (lambda t: t.t()) if arch.transposed else (lambda t: t)  # noqa: E731
    if weight == "w_down":
        return view(module.down_proj[expert])
    if not hasattr(module, "gate_up_proj"):
        if weight != "w_up":
            raise FFNQuantError(f"{type(module).__name__} has no gate: its experts have no {weight}")
        return view(module.up_proj[expert])
    both = view(module.gate_up_proj[expert])
    gate, up = (both[0::2], both[1::2]) if arch.interleaved else both.chunk(2, dim=0)
    return gate if weight == "w_gate" else up


def expert_forward(module: nn.Module, expert: int, transposed: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """One expert of a fused experts module (MixtralExperts' math: gate_up_proj [E, 2f, d], gate rows first, and
    down_proj [E, d, f]; its own `_apply_gate` of the gate_up product where it has one; or, without a gate,
    NemotronHExperts': up_proj [E, f, d] through the activation) as a callable on its tokens [tokens, d_model].
    `transposed`: input-major tensors [E, in, out], each with its `<name>_bias` [E, out] where it has one (gpt-oss')."""
    act = getattr(module, "act_fn", None)

    def lin(x: torch.Tensor, name: str) -> torch.Tensor:
        w, b = getattr(module, name)[expert], getattr(module, f"{name}_bias", None)
        y = x @ w if transposed else nn.functional.linear(x, w)
        return y + b[expert] if isinstance(b, torch.Tensor) else y

    if not hasattr(module, "gate_up_proj"):
        def forward(x: torch.Tensor) -> torch.Tensor:
            return lin(act(lin(x, "up_proj")), "down_proj")

        return forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        gate_up = lin(x, "gate_up_proj")
        if callable(getattr(module, "_apply_gate", None)):  # its own gate function of both halves (MiniMax-M3)
            return lin(module._apply_gate(gate_up), "down_proj")
        gate, up = gate_up.chunk(2, dim=-1)
        return lin(act(gate) * up, "down_proj")

    return forward


def routed_rows(module: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a call of a fused experts module hands its experts: rows [n, d], each row's experts [n, k] and the
    weights of their outputs [n, k]. Tokens with their top-k experts and weights, however the MoE block passes them
    (positionally, or by the module's own names: gpt-oss' router_indices and routing_weights); or, for a module that
    takes every expert's rows stacked (Llama 4's, `probe.takes_sorted_tokens`), each row with its one expert and
    weight 1 (its MoE block scaled the row by the router already, zero where the token is not routed there)."""
    if takes_sorted_tokens(module):
        rows = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
        rows = rows.reshape(-1, rows.shape[-1])
        experts = torch.arange(module.num_experts, device=rows.device)
        index = experts.repeat_interleave(rows.shape[0] // module.num_experts)[:, None]
        return rows, index, torch.ones(index.shape, dtype=rows.dtype, device=rows.device)
    try:
        bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs)
        hidden, index, weights = list(bound.arguments.values())[1:4]
    except TypeError:
        hidden, index, weights = (list(args) + list(kwargs.values()))[:3]
    return hidden.reshape(-1, hidden.shape[-1]), index, weights


def experts_forward(module: nn.Module, replacements: Mapping[int, Callable[[torch.Tensor], torch.Tensor]],
                    transposed: bool = False):
    """A forward for a fused experts module with some experts replaced: each row through its experts, weighted
    and summed per row (`routed_rows`), in transformers' order and arithmetic (MixtralExperts')."""

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        shape = (args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))).shape
        rows, top_k_index, top_k_weights = routed_rows(module, args, kwargs)
        out = torch.zeros_like(rows)
        for expert in range(module.num_experts):
            token_idx, top_k_pos = torch.where(top_k_index == expert)  # an expert appears at most once per row
            if token_idx.numel() == 0:
                continue
            y = (replacements[expert] if expert in replacements else expert_forward(module, expert, transposed))(
                rows[token_idx])
            y = y * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out.reshape(shape)

    return forward
