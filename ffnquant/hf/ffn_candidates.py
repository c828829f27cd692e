"""The FFN-shaped sets of matrices in a decoder block, by structure alone (`candidates`): a module's Linears mapping
the width out and back (separate, fused gate+up, Conv1D, the block's own Linears, an FFN's first matrices one
level down, an FFN split across two of the block's modules) and fused 3-D expert tensors. `hf.discover` probes
each by running it; what is found is a `FoundFFN`."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from ..spec import Activation
from .arch import Install

__all__ = ["FoundFFN", "candidates", "expert_matrices", "input_major", "linear_shape"]


@dataclass(frozen=True)
class FoundFFN:
    """One FFN shape of a block: where it is (relative to the block, '' = the block's own Linears), how it is
    installed, its matrices by attribute name (-> "w_gate", "w_up", "w_down", "w_gate+w_up" or "w_up+w_gate")."""

    path: str
    install: Install
    roles: Mapping[str, str]
    d_model: int
    d_ff: int
    gated: bool
    transposed: bool = False
    bias: bool = False
    experts: int | None = None
    activation: Activation | None = None
    act_attr: str = ""  # the activation module's attribute (SPLIT: the block's)
    linear_class: str = "Linear"  # the class of its matrices' modules (FalconLinear, Conv1D, ...)
    # the module's forward takes the block's residual as its second argument and returns FFN(x) + residual (BLOOM,
    # MPT): checked by running it; what replaces it adds the residual the same way
    residual: bool = False
    # `Activation.OWN`: a copy of the model's own activation module (on the meta device, as the model was built),
    # which each layer's checkpoint fills (`hf.checkpoint`); `act_attr` is where it sits in the FFN's module
    act_module: Any = field(default=None, compare=False, repr=False)
    # routed experts: the tensors holding each expert's matrix [in, out] (all of them: `transposed`; DBRX's w2
    # alone), and whether they are flat [experts x rows, cols] rather than 3-D (DBRX's); `hf.routed.expert_matrices`
    input_major: tuple[str, ...] = ()
    flat_experts: bool = False
    # routed experts whose matrices are child modules of a module that routes the tokens itself, each child called
    # with the rows sorted by expert and every expert's row count (JetMoE's MoE: input_linear, output_linear)
    matrix_experts: bool = False

    def key(self) -> tuple:
        return (self.path, self.install, tuple(sorted(self.roles.items())), self.d_model, self.d_ff, self.experts)


def linear_shape(module: nn.Module) -> tuple[int, int, bool] | None:
    """(in, out, transposed) of a Linear-like module: nn.Linear (and subclasses) or transformers' Conv1D."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return int(weight.shape[0]), int(weight.shape[1]), True
    return None


def input_major(layout: Any, name: str) -> bool:
    """Whether the experts tensor `name` holds each expert's matrix [in, out] (gpt-oss' all of them, `transposed`;
    DBRX's w2 alone, `input_major`) rather than [out, in]. `layout`: a `FoundFFN` or an `Arch`."""
    return bool(layout.transposed) or name in tuple(getattr(layout, "input_major", ()) or ())


def expert_matrices(tensor: torch.Tensor, name: str, layout: Any, n_experts: int) -> torch.Tensor:
    """Every expert's matrix of one fused experts tensor as a view [experts, out, in]: a 3-D tensor [E, out, in]
    or [E, in, out] (`input_major`), or a flat 2-D one holding the experts' matrices stacked [E x rows, cols]
    (DBRX's, `flat_experts`). A view: writing into it writes the tensor."""
    t = tensor if tensor.dim() == 3 else tensor.view(n_experts, -1, tensor.shape[-1])
    return t.transpose(1, 2) if input_major(layout, name) else t


def candidates(block: nn.Module, d: int) -> list[FoundFFN]:
    """Every FFN-shaped set of matrices in a block (structure only; roles of gated pairs not yet known)."""
    out: list[FoundFFN] = []
    for path, module in block.named_modules():
        experts = _experts_of(path, module, d)
        if experts:
            out += experts
            continue
        linears = {n: linear_shape(c) for n, c in module.named_children()}
        linears = {n: s for n, s in linears.items() if s is not None}
        if path and not any(d in (i, o) for i, o, _ in linears.values()):
            # no Linear of the model's width of its own: its FFN's Linears one level down, in wrappers of one
            # Linear each (Reformer's feed_forward.dense.dense and .output.dense, its activation beside the first);
            # a child holding several is a candidate by itself (an attention, an MLP)
            for c, child in module.named_children():
                inner = {f"{c}.{n}": linear_shape(m) for n, m in child.named_children()}
                inner = {n: s for n, s in inner.items() if s is not None}
                if len(inner) == 1:
                    linears.update(inner)
        downs = [n for n, (i, o, _) in linears.items() if o == d and i != d]
        if path and downs and not any(i == d and o != d for i, o, _ in linears.values()):
            # the first matrices one level down (CPM-Ant's w_in.w_0, w_in.w_1 beside its w_out)
            deeper = {f"{c}.{n}": linear_shape(m) for c, child in module.named_children() if c not in linears
                      for n, m in child.named_children()}
            linears.update({n: s for n, s in deeper.items() if s is not None and s[0] == d and s[1] != d})
        for down in downs:
            f = linears[down][0]
            ups = [n for n, (i, o, _) in linears.items() if i == d and o in (f, 2 * f) and n != down]
            full = [n for n in ups if linears[n][1] == f]
            fused = [n for n in ups if linears[n][1] == 2 * f]
            transposed = linears[down][2]
            bias = any(getattr(module.get_submodule(n), "bias", None) is not None for n in [down, *ups])
            install = Install.MODULE if path else Install.SPLIT
            cls = type(module.get_submodule(down)).__name__
            if len(full) == 2 and not fused:
                roles = {full[0]: "w_gate", full[1]: "w_up", down: "w_down"}  # order settled by the probe
                out.append(FoundFFN(path, install, roles, d, f, True, transposed, bias, linear_class=cls))
            elif len(fused) == 1 and not full:
                out.append(FoundFFN(path, install, {fused[0]: "w_gate+w_up", down: "w_down"}, d, f, True, transposed, bias,
                                    linear_class=cls))
            elif len(full) == 1 and not fused:
                out.append(FoundFFN(path, install, {full[0]: "w_up", down: "w_down"}, d, f, False, transposed, bias,
                                    linear_class=cls))
    # beside any other (X-MOD's language adapter is an MLP module of its own, its main FFN split across children)
    return out + [c for c in _split_across_children(block, d) if c not in out]


def _experts_of(path: str, module: nn.Module, d: int) -> list[FoundFFN]:
    """Every reading of a module's routed experts (`_expert_tensors`): 3-D tensors of its own (Mixtral's, gpt-oss'),
    else one 3-D tensor in each of its children called with the rows sorted by expert (JetMoE's), else flat 2-D ones
    in it or its children (DBRX's). [] when it holds none (3-D tensors of another kind, RWKV's token-shift mixes
    [1, 1, d], leave its Linears to count)."""
    params3 = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False) if p.dim() == 3}
    if params3:
        return _expert_tensors(path, module, params3, d, False) if len(params3) in (2, 3) else []
    per_child = _matrix_children(module)
    if per_child:
        return [dataclasses.replace(e, matrix_experts=True) for e in _expert_tensors(path, module, per_child, d, False)]
    flat = _flat_experts(module)
    return _expert_tensors(path, module, flat, d, True) if flat else []


def _matrix_children(module: nn.Module) -> dict[str, tuple[int, int, int]]:
    """Two or three children each holding one 3-D tensor [experts, a, b] of its own and called with two arguments
    (JetMoE's ParallelExperts: forward(inputs, expert_size), the rows sorted by expert and each expert's count):
    '<child>.<tensor>' -> its shape; {} otherwise."""
    out = {}
    for c, child in module.named_children():
        own = [(n, p) for n, p in child.named_parameters(recurse=False) if p.dim() == 3]
        if len(own) == 1 and not any(True for _ in child.children()) and _arguments(child) == 2:
            out[f"{c}.{own[0][0]}"] = tuple(int(x) for x in own[0][1].shape)
    return out if len(out) in (2, 3) else {}


def _arguments(module: nn.Module) -> int:
    """How many arguments the module's forward takes (-1 when it cannot be told)."""
    try:
        return len(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return -1


def _flat_experts(module: nn.Module) -> dict[str, tuple[int, int, int]]:
    """A module of `num_experts` experts (an int attribute) holding their matrices as flat 2-D parameters, each
    expert's rows stacked [experts x rows, cols], in it or its children (DBRX's experts.mlp.w1, v1, w2): name ->
    (experts, rows, cols); {} when it holds no such set of two or three."""
    n = getattr(module, "num_experts", None)
    if not isinstance(n, int) or isinstance(n, bool) or n < 2 or any(p.dim() == 3 for p in module.parameters()):
        return {}
    linears = {name for name, m in module.named_modules() if linear_shape(m) is not None}
    flat = {name: (n, int(p.shape[0]) // n, int(p.shape[1])) for name, p in module.named_parameters()
            if p.dim() == 2 and p.shape[0] % n == 0 and p.shape[0] > n and name.rpartition(".")[0] not in linears}
    return flat if len(flat) in (2, 3) else {}


def _expert_tensors(path: str, module: nn.Module, shapes: Mapping[str, tuple[int, int, int]], d: int,
                    flat: bool) -> list[FoundFFN]:
    """Two or three tensors holding every expert's matrices (`shapes`: name -> experts, rows, cols), each
    output-major [E, out, in] (Mixtral's: each row an output) or input-major [E, in, out] (gpt-oss' all, DBRX's
    down alone), each with an optional `<name>_bias` [E, out] (gpt-oss'): every reading of them as one expert's FFN
    (a down matrix f -> d beside a fused gate+up d -> 2f, an up d -> f, or a gate and an up d -> f); the probe keeps
    the one the module computes. [] when they read as none."""
    names = list(shapes)
    # one number of experts, at least two (RWKV's token-shift mixes [1, 1, d] are no experts)
    if len({s[0] for s in shapes.values()}) != 1 or next(iter(shapes.values()))[0] < 2:
        return []
    out = []
    for majors in itertools.product((False, True), repeat=len(names)):
        dims = {n: (shapes[n][2], shapes[n][1]) if m else (shapes[n][1], shapes[n][2]) for n, m in zip(names, majors)}
        # the down matrix maps f back to d; where f == d (square experts) any [d, d] tensor may be it: each tried
        for down in [n for n, (o, i) in dims.items() if o == d]:
            f = dims[down][1]
            firsts = [n for n in names if n != down]
            widths = sorted(dims[n][0] for n in firsts)
            if f < 2 or any(dims[n][1] != d for n in firsts) or widths not in ([f], [2 * f], [f, f]):
                continue
            roles = ({firsts[0]: "w_up"} if widths == [f] else {firsts[0]: "w_gate+w_up"} if widths == [2 * f]
                     else {firsts[0]: "w_gate", firsts[1]: "w_up"})  # gate or up: settled by the probe
            roles[down] = "w_down"
            input_major = tuple(n for n, m in zip(names, majors) if m)
            biases = [getattr(module, f"{n}_bias", None) for n in names]
            bias = any(isinstance(t, torch.Tensor) and t.dim() == 2 for t in biases)
            out.append(FoundFFN(path, Install.EXPERTS, roles, d, f, widths != [f], all(majors), bias,
                                experts=shapes[names[0]][0], linear_class=type(module).__name__,
                                input_major=input_major, flat_experts=flat))
    return out


def _split_across_children(block: nn.Module, d: int) -> list[FoundFFN]:
    """An FFN whose two Linears sit in two children of the block (BERT's intermediate.dense, d -> f, then the
    activation; output.dense, f -> d, whose module then adds the residual and normalises): the block's own FFN,
    installed Linear by Linear (`Install.SPLIT`, dotted attributes)."""
    nested = {f"{c}.{n}": linear_shape(m) for c, child in block.named_children() for n, m in child.named_children()}
    nested = {n: s for n, s in nested.items() if s is not None}
    out = []
    for down, (i, o, transposed) in nested.items():
        if o != d or i == d:
            continue
        ups = [n for n, (a, b, _) in nested.items() if a == d and b == i and n.split(".")[0] != down.split(".")[0]]
        if len(ups) == 1:
            bias = any(getattr(block.get_submodule(n), "bias", None) is not None for n in (ups[0], down))
            out.append(FoundFFN("", Install.SPLIT, {ups[0]: "w_up", down: "w_down"}, d, i, False, transposed, bias,
                                linear_class=type(block.get_submodule(down)).__name__))
    return out
