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
from .ffn_candidates import expert_matrices, input_major
from .probe import takes_sorted_tokens

__all__ = ["call_modules", "expert_bias", "expert_forward", "expert_matrices", "expert_tensors", "expert_weight",
           "experts_forward", "input_major", "matrix_forwards", "routed_rows"]


def _n_experts(module: nn.Module, layout: Any) -> int:
    fixed = getattr(layout, "fixed", None) or {}
    n = getattr(layout, "experts", None) or fixed.get("n_experts") or getattr(module, "num_experts", None)
    if not isinstance(n, int):
        raise FFNQuantError(f"{type(module).__name__}: the number of its experts is not known")
    return n


def expert_tensors(module: nn.Module, layout: Any) -> dict[str, str]:
    """role ("w_down", "w_gate+w_up", ...) -> the experts module's tensor holding it (a dotted name: DBRX's mlp.w1)."""
    fused = getattr(layout, "fused_expert_roles", None)  # an Arch's roles also name the per-expert tensors on disk
    names = {n: layout.roles.get(n, "") for n in fused} if fused else dict(layout.roles)
    out = {}
    for name, role in names.items():
        try:
            module.get_parameter(name)
        except AttributeError:
            continue
        out[role or ("w_down" if name.endswith("down_proj") else "w_gate+w_up" if "gate" in name else "w_up")] = name
    return out


def expert_weight(module: nn.Module, expert: int, weight: str, arch: Any) -> torch.Tensor:
    """One routed expert's `weight` ("w_gate", "w_up", "w_down", [out, in]) as a view of the fused experts module's
    tensors, in the layout `arch` read them in (`hf.checkpoint`): each tensor output- or input-major, 3-D or flat
    (`expert_matrices`); gate and up in separate tensors, or in one side by side (gate first) or alternating
    (`arch.interleaved`). A view: writing into it writes the module's tensor."""
    tensors = expert_tensors(module, arch)
    n = _n_experts(module, arch)

    def view(name: str) -> torch.Tensor:
        return expert_matrices(module.get_parameter(name), name, arch, n)[expert]

    if weight in tensors:
        return view(tensors[weight])
    fused = next((r for r in ("w_gate+w_up", "w_up+w_gate") if r in tensors), None)
    if fused is None or weight not in ("w_gate", "w_up"):
        raise FFNQuantError(f"{type(module).__name__} holds no {weight} of its experts (it holds "
                            f"{', '.join(sorted(tensors))})")
    both = view(tensors[fused])
    first, second = (both[0::2], both[1::2]) if getattr(arch, "interleaved", False) else both.chunk(2, dim=0)
    gate, up = (first, second) if fused == "w_gate+w_up" else (second, first)
    return gate if weight == "w_gate" else up


def expert_bias(module: nn.Module, expert: int, weight: str, arch: Any) -> torch.Tensor | None:
    """One routed expert's bias of `weight` as a view of the fused experts module's `<tensor>_bias` [E, out]
    (gpt-oss'), gate and up halves as `expert_weight` reads them; None where the module holds no such bias."""
    tensors = expert_tensors(module, arch)
    fused = next((r for r in ("w_gate+w_up", "w_up+w_gate") if r in tensors), None)
    name = tensors.get(weight) or (tensors[fused] if fused and weight in ("w_gate", "w_up") else None)
    bias = getattr(module, f"{name}_bias", None) if name and "." not in name else None
    if not isinstance(bias, torch.Tensor):
        return None
    row = bias.view(_n_experts(module, arch), -1)[expert]
    if weight in tensors:
        return row
    first, second = (row[0::2], row[1::2]) if getattr(arch, "interleaved", False) else row.chunk(2, dim=0)
    gate, up = (first, second) if fused == "w_gate+w_up" else (second, first)
    return gate if weight == "w_gate" else up


def _activation(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The experts' activation module: `act_fn` (transformers' name), else the parameterless child whose name says
    activation (DBRX's mlp.activation_fn)."""
    act = getattr(module, "act_fn", None)
    if callable(act):
        return act
    for name, child in module.named_modules():
        if name and "act" in name.rpartition(".")[2] and not any(True for _ in child.parameters()):
            return child
    raise FFNQuantError(f"{type(module).__name__}: no activation module found beside its experts' tensors")


def expert_forward(module: nn.Module, expert: int, layout: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """One expert of a fused experts module as a callable on its tokens [tokens, d_model], in transformers' math:
    gate and up (one tensor, gate rows first as MixtralExperts chunks it, or two tensors: DBRX's), the module's own
    `_apply_gate` of the gate_up product where it has one (MiniMax-M3, gpt-oss), else activation(gate) * up; without
    a gate (NemotronHExperts') the activation of up; then down. Each tensor in its layout (`expert_matrices`), each
    with its `<name>_bias` [E, out] where it has one (gpt-oss')."""
    tensors = expert_tensors(module, layout)
    n = _n_experts(module, layout)

    def lin(x: torch.Tensor, role: str) -> torch.Tensor:
        name = tensors[role]
        w = expert_matrices(module.get_parameter(name), name, layout, n)[expert]
        b = getattr(module, f"{name}_bias", None) if "." not in name else None
        # an input-major matrix multiplies as stored (x @ w), as its module does: same summation order
        y = x @ w.t() if input_major(layout, name) else nn.functional.linear(x, w)
        return y + b[expert] if isinstance(b, torch.Tensor) else y

    fused = next((r for r in ("w_gate+w_up", "w_up+w_gate") if r in tensors), None)
    own_gate = getattr(module, "_apply_gate", None) if fused is not None else None
    act = None if callable(own_gate) else _activation(module)  # looked up once, not per call

    def forward(x: torch.Tensor) -> torch.Tensor:
        if fused is not None:
            gate_up = lin(x, fused)
            if callable(own_gate):  # its own gate function of both halves (MiniMax-M3)
                return lin(own_gate(gate_up), "w_down")
            gate, up = gate_up.chunk(2, dim=-1)
            if fused == "w_up+w_gate":
                gate, up = up, gate
        elif "w_gate" in tensors:
            gate, up = lin(x, "w_gate"), lin(x, "w_up")
        else:
            return lin(act(lin(x, "w_up")), "w_down")
        return lin(act(gate) * up, "w_down")

    return forward


def call_modules(module: nn.Module, layout: Any) -> tuple[nn.Module, nn.Module]:
    """(the module whose call hands the experts their rows, the one that returns their outputs): the fused experts
    module itself twice; for experts whose matrices are child modules (`matrix_experts`, JetMoE's), the child of
    the first matrix (rows sorted by expert) and that of down (each row's expert output, before the gates)."""
    if not getattr(layout, "matrix_experts", False):
        return module, module
    tensors = expert_tensors(module, layout)
    first = next(n for r, n in tensors.items() if r != "w_down")
    return (module.get_submodule(first.rpartition(".")[0]), module.get_submodule(tensors["w_down"].rpartition(".")[0]))


def _matrix_child(module: nn.Module, args: tuple) -> bool:
    """Whether this is a call of one experts matrix module with the rows sorted by expert and each expert's count
    (JetMoE's ParallelExperts(inputs, expert_size))."""
    own = [p for p in module.parameters(recurse=False) if p.dim() == 3]
    return len(own) == 1 and len(args) >= 2 and isinstance(args[1], (list, tuple, torch.Tensor)) \
        and len(args[1]) == own[0].shape[0]


def routed_rows(module: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a call of a fused experts module hands its experts: rows [n, d], each row's experts [n, k] and the
    weights of their outputs [n, k]. The call of an experts matrix module with the rows sorted by expert and
    their counts (JetMoE's, `call_modules`): each row with its expert and weight 1 (the gates apply after). Tokens
    with their top-k experts and weights, however the MoE block passes them (positionally, or by the module's own names: gpt-oss' router_indices and routing_weights); or, for a module that
    takes every expert's rows stacked (Llama 4's, `probe.takes_sorted_tokens`), each row with its one expert and
    weight 1 (its MoE block scaled the row by the router already, zero where the token is not routed there)."""
    if _matrix_child(module, args):  # rows sorted by expert, with each expert's count: each row its expert, weight 1
        rows, counts = args[0], [int(c) for c in args[1]]
        index = torch.arange(len(counts), device=rows.device).repeat_interleave(
            torch.tensor(counts, device=rows.device))[:, None]
        return rows.reshape(-1, rows.shape[-1]), index, torch.ones(index.shape, dtype=rows.dtype, device=rows.device)
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
                    layout: Any):
    """A forward for a fused experts module with some experts replaced: each row through its experts, weighted
    and summed per row (`routed_rows`), in transformers' order and arithmetic (MixtralExperts')."""
    experts = _with_own(module, replacements, layout)

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        shape = (args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))).shape
        rows, top_k_index, top_k_weights = routed_rows(module, args, kwargs)
        out = torch.zeros_like(rows)
        for expert in range(len(experts)):
            token_idx, top_k_pos = torch.where(top_k_index == expert)  # an expert appears at most once per row
            if token_idx.numel() == 0:
                continue
            y = experts[expert](rows[token_idx]) * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out.reshape(shape)

    return forward


def _with_own(module: nn.Module, replacements: Mapping[int, Callable[[torch.Tensor], torch.Tensor]],
              layout: Any) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """Every expert's callable, by id: its replacement, or the model's own math (`expert_forward`)."""
    return [replacements[e] if e in replacements else expert_forward(module, e, layout)
            for e in range(_n_experts(module, layout))]


def matrix_forwards(module: nn.Module, replacements: Mapping[int, Callable[[torch.Tensor], torch.Tensor]],
                    layout: Any) -> dict[nn.Module, Callable[..., torch.Tensor]]:
    """Forwards for the two matrix modules of experts held as child modules (`call_modules`; JetMoE's) with some
    experts replaced: the first computes each expert's whole FFN on its rows (a replacement, or the model's own
    math) and keeps the outputs, handing on zeros, which the module's activation and product leave zeros (act(0)
    x 0); down returns the kept outputs, row for row, for the module to weigh and sum as it does."""
    first, down = call_modules(module, layout)
    experts = _with_own(module, replacements, layout)
    kept: list[torch.Tensor] = []
    name = next(n for r, n in expert_tensors(module, layout).items() if r != "w_down")
    width = expert_matrices(module.get_parameter(name), name, layout, _n_experts(module, layout)).shape[1]  # its out

    def first_forward(inputs: torch.Tensor, expert_size: Any) -> torch.Tensor:
        counts = [int(c) for c in expert_size]
        outs = [experts[e](rows) if rows.shape[0] else rows.new_zeros(0, rows.shape[-1])
                for e, rows in enumerate(inputs.split(counts, dim=0))]
        kept.clear()
        kept.append(torch.cat(outs).to(inputs.dtype))
        return inputs.new_zeros(inputs.shape[0], width)

    def down_forward(hidden: torch.Tensor, expert_size: Any) -> torch.Tensor:
        return kept.pop()

    return {first: first_forward, down: down_forward}
