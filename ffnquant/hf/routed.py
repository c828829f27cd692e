"""Routed experts held as 3-D tensors in one module, as transformers (>= 5) computes them: one expert's FFN
(`expert_forward`: output-major or input-major tensors, biases, the module's own gate function), the arguments of a
call however the MoE block passes them (`routed_call`), and the module's forward with some experts replaced
(`experts_forward`: tokens with their top-k experts and weights, or every expert on its own block of rows)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

import torch
from torch import nn

from .probe import takes_sorted_tokens

__all__ = ["expert_forward", "experts_forward", "routed_call"]


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


def routed_call(module: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden states, top-k expert indices, top-k weights) of a call to a fused experts module, however its MoE
    block passes them (positionally, or by its own names: gpt-oss' router_indices and routing_weights)."""
    try:
        bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs)
    except TypeError:
        return tuple((list(args) + list(kwargs.values()))[:3])  # type: ignore[return-value]
    return tuple(list(bound.arguments.values())[1:4])  # type: ignore[return-value]


def experts_forward(module: nn.Module, replacements: Mapping[int, Callable[[torch.Tensor], torch.Tensor]],
                     transposed: bool = False):
    """A forward for a fused experts module (MixtralExperts' math) with some experts replaced."""

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        if takes_sorted_tokens(module):  # every expert on its own block of rows (Llama 4's)
            rows = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            per_expert = rows.reshape(module.num_experts, -1, rows.shape[-1])
            return torch.cat([(replacements[e] if e in replacements else expert_forward(module, e, transposed))(
                per_expert[e]).to(rows.dtype) for e in range(module.num_experts)])
        hidden_states, top_k_index, top_k_weights = routed_call(module, args, kwargs)
        out = torch.zeros_like(hidden_states)
        for expert in range(module.num_experts):
            top_k_pos_mask = top_k_index == expert  # [tokens, k]; an expert appears at most once per token
            token_idx, top_k_pos = torch.where(top_k_pos_mask)
            if token_idx.numel() == 0:
                continue
            x = hidden_states[token_idx]
            y = (replacements[expert] if expert in replacements else expert_forward(module, expert, transposed))(x)
            y = y * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    return forward
