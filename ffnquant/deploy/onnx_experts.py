"""Routed experts in the whole-model ONNX graph: each fused experts module exported as one onnxruntime MoE node
(float experts) or QMoE node (the plan's integer codes), `onnx.moe` says what each computes.

While torch.onnx exports the model, `ExpertsInGraph` puts a `GraphExperts` in place of every experts module. Run
eagerly it is the module itself (the export's parity check compares against the model's own math); exported, it is
the operator, handed what the model's MoE block handed its experts (`hf.routed.routed_rows`: the rows, each row's
top-k experts and their weights), so the router, its top-k and any scaling stay the model's own graph.

What the operator computes is found from the module's behaviour (`experts_op`): onnxruntime's activation with
each candidate's parameters (SiLU-GLU, gpt-oss' clamped gate with the module's own alpha and limit, the ungated
activations) against `hf.routed.expert_forward` on probe rows, one expert at a time; none matching is a refusal
naming the module. Refused too: experts whose MoE block scales their input by the router (Llama 4's every-expert
rows) and experts held as child modules called with sorted rows (JetMoE's), which the operator's call does not take.

onnxruntime 1.31's CPU MoE kernel returns a wrong sum where its output may take its input's buffer (the input has
no later reader; measured on Qwen3-MoE, and on a six-node graph in tests/test_deploy_onnx_experts.py): the float
node's input is kept read after it (a Concat its output is sliced back from).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
from torch import nn

from ..errors import FFNQuantError
from ..hf.routed import _n_experts, expert_bias, expert_forward, expert_tensors, expert_weight, routed_rows
from ..schemes import Method
from ..onnx.moe import UNGATED, ExpertsOp, activation, qmoe_tensors, qmoe_weight_refusal

if TYPE_CHECKING:  # annotations only
    from ..hf.checkpoint import ModelInfo
    from .planned import ModuleQuant

__all__ = ["GraphExperts", "experts_call_refusal", "ExpertsInGraph", "experts_op", "experts_recipe_refusal"]

# the node metadata naming the experts module a MoE / QMoE node computes
EXPERTS_KEY = "ffnquant_experts"
# a selected expert's routing weight below this enters the float node's softmax as this (log(0) has no softmax)
_TINY = 1e-37
# an unselected expert's logit: no weight beside any selected one, and a finite softmax where a row selects none
_UNCHOSEN = -1e30


def experts_call_refusal(module: nn.Module, info: ModelInfo) -> str | None:
    """Why an experts module's call cannot become one MoE/QMoE node (one line), None when it can."""
    from ..hf.probe import takes_sorted_tokens

    name = type(module).__name__
    if getattr(info.arch, "matrix_experts", False):
        return (f"{name}: its experts are child modules called with the rows sorted by expert (their gates applied "
                "after), not onnxruntime MoE's call of every row with its top-k experts and weights")
    if takes_sorted_tokens(module):
        return (f"{name}: its MoE block scales each row by the router before the experts (every expert's rows "
                "stacked), where onnxruntime's MoE weighs the experts' outputs")
    return None


def experts_recipe_refusal(recipe: Any, info: ModelInfo) -> str | None:
    """Why QMoE cannot store routed experts under `recipe` (one line), None when it can (fp32 keeps them a float
    MoE node). Decided from the recipe alone, as `backends.supports` decides a matmul's."""
    if recipe.is_float:
        return None
    scheme = recipe.resolve()
    weights, sites = recipe.quantized_parts(info.spec)
    why = None
    if sites and not scheme.act_dtype.is_float:
        why = "it quantizes the experts' inputs, and QMoE computes on float activations (weight-only)"
    elif scheme.weight_dtype.is_float or scheme.weight_dtype.value not in ("int4", "int8"):
        why = f"its {scheme.weight_dtype.value} weights are not QMoE's 4- or 8-bit integers"
    elif set(weights) != set(info.spec.weight_names):
        why = "it keeps some expert matrices float, and QMoE stores every matrix of an expert quantized"
    elif scheme.method is Method.HQQ:
        why = "HQQ's zero points are floats, and QMoE's are integer codes"
    elif getattr(recipe, "smooth", None) is not None or getattr(recipe, "rotate", False) or scheme.method is Method.AWQ:
        why = "it scales or rotates the experts' input, which the router reads too"
    else:
        bits = 4 if scheme.weight_dtype.value == "int4" else 8
        why = qmoe_weight_refusal(bits, scheme.weight_granularity.value, scheme.group_size, info.spec.d_model,
                                  info.spec.d_ff)
    return None if why is None else f"routed experts cannot take {recipe} in the whole-model ONNX graph: {why}"


# --- what the experts compute -------------------------------------------------------------------------

def _float_tensors(module: nn.Module, arch: Any) -> dict[str, torch.Tensor | None]:
    """fc1 [E, 2f, d] (gate and up rows interleaved; [E, f, d] ungated), fc2 [E, d, f] and their biases [E, n] or
    None, read through the views ffnquant reads experts with, float32."""
    n = _n_experts(module, arch)
    gated = any(r in expert_tensors(module, arch) for r in ("w_gate", "w_gate+w_up", "w_up+w_gate"))

    def stack(weight: str, bias: bool = False) -> torch.Tensor | None:
        get = expert_bias if bias else expert_weight
        parts = [get(module, e, weight, arch) for e in range(n)]
        return None if any(p is None for p in parts) else torch.stack([p.detach().float() for p in parts])

    if gated:
        gate, up = stack("w_gate"), stack("w_up")
        fc1 = torch.stack([gate, up], 2).reshape(n, -1, gate.shape[-1])
        bg, bu = stack("w_gate", True), stack("w_up", True)
        b1 = None if bg is None or bu is None else torch.stack([bg, bu], 2).reshape(n, -1)
    else:
        fc1, b1 = stack("w_up"), stack("w_up", True)
    return {"fc1": fc1.contiguous(), "b1": b1, "fc2": stack("w_down").contiguous(), "b2": stack("w_down", True)}


def _candidates(module: nn.Module, gated: bool, k: int) -> list[ExpertsOp]:
    """The operator's activations to try, the module's own parameters (gpt-oss' alpha and limit) first."""
    if not gated:
        return [ExpertsOp(a, k) for a in UNGATED]
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    alphas = [float(alpha)] if isinstance(alpha, (int, float)) else []
    limits = [float(limit)] if isinstance(limit, (int, float)) and math.isfinite(limit) else []
    return [ExpertsOp("swiglu", k, a, b, lim) for lim in limits + [None] for a in alphas + [1.0] for b in (0.0, 1.0)]


def experts_op(module: nn.Module, arch: Any, k: int, tensors: Mapping[str, torch.Tensor | None] | None = None,
               probe_rows: int = 64) -> ExpertsOp:
    """What onnxruntime's operator must compute to be this experts module (see the module docstring): the first
    candidate whose output on probe rows is the model's own expert's (`expert_forward`) for every expert, within
    float32 rounding; FFNQuantError naming the module where none is."""
    t = tensors or _float_tensors(module, arch)
    fc1, fc2, b1, b2 = t["fc1"], t["fc2"], t["b1"], t["b2"]
    gated = fc1.shape[1] == 2 * fc2.shape[2]
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(probe_rows, fc1.shape[2], generator=gen)
    candidates = _candidates(module, gated, k)
    limit = max((c.limit for c in candidates if c.limit is not None), default=None)
    outs = []
    with torch.no_grad():
        for e in range(fc1.shape[0]):
            x = rows
            if limit is not None:  # rows reaching past the clamp, so that a clamp shows
                pre = (x @ fc1[e].T).abs().max().clamp_min(1e-12)
                x = x * (3.0 * limit / pre)
            want = expert_forward(module, e, arch)(x).float()
            pre = x @ fc1[e].T + (b1[e] if b1 is not None else 0.0)
            outs.append((x, pre, want))
        for op in candidates:
            if all(_close(activation(op, pre) @ fc2[e].T + (b2[e] if b2 is not None else 0.0), want)
                   for e, (x, pre, want) in enumerate(outs)):
                return op
    tried = ", ".join(sorted({c.activation for c in candidates}))
    raise FFNQuantError(f"{type(module).__name__}: no activation of onnxruntime's MoE ({tried}, with the module's "
                        "own parameters) reproduces its experts, so no MoE/QMoE node computes them")


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    # float32 rounding of two summation orders: far below any difference between two activations
    scale = float(want.abs().max()) + 1e-30
    return bool(torch.isfinite(got).all()) and float((got - want).abs().max()) <= 1e-4 * scale


# --- the quantized tensors ---------------------------------------------------------------------------

def _grid_parts(mq: ModuleQuant, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes [N, K], scales [N] or [N, blocks], zero points alike or None) of one expert matrix."""
    grid = mq.grid
    scale = grid.scale.float()
    zp = grid.zero_point
    if grid.granularity == "per_channel":
        scale = scale.reshape(-1)
        zp = None if zp is None else zp.reshape(-1)
    return codes, scale, None if grid.symmetric else zp


def quantized_experts(modules: Sequence[ModuleQuant], weight_of: Any, d_model: int, d_ff: int,
                      gated: bool) -> dict[str, Any]:
    """QMoE's fc1 and fc2 (`onnx.moe.qmoe_tensors`) from one experts module's ModuleQuants, every expert's codes
    checked to give its planned weight back (`deploy.onnx_rewrite._codes`); their bits and block. FFNQuantError
    where the module's matrices are not all quantized on one QMoE grid."""
    from .onnx_rewrite import _codes

    by = {(mq.expert, mq.weight): mq for mq in modules}
    experts = sorted({mq.expert for mq in modules})
    if experts != list(range(len(experts))):
        raise FFNQuantError(f"{modules[0].fused}: the plan quantizes experts {experts[:4]}..., not every expert of it")
    first = modules[0]
    if any(mq.input_mode is not None or mq.rotation is not None for mq in modules):
        raise FFNQuantError(f"{first.fused} (recipe {first.recipe}): its experts' inputs are quantized or rotated, and "
                            "QMoE computes on float activations (weight-only)")
    grids = {(mq.grid.bits, mq.grid.granularity, mq.grid.group_size) if mq.grid is not None else None
             for mq in modules}
    if len(grids) != 1 or None in grids:
        raise FFNQuantError(f"{first.fused}: QMoE stores every matrix of every expert on one integer grid; the plan's "
                            f"are {sorted(map(str, grids))}")
    bits, granularity, group = grids.pop()
    why = qmoe_weight_refusal(bits, granularity, group, d_model, d_ff)
    if why is not None:
        raise FFNQuantError(f"{first.fused} (recipe {first.recipe}): {why}")

    def parts(weight: str) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        out = []
        for e in experts:
            mq = by.get((e, weight))
            if mq is None:
                raise FFNQuantError(f"{first.fused}: expert {e} has no planned {weight}")
            out.append(_grid_parts(mq, _codes(mq, weight_of(mq))))
        return out

    def stacked(items: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        codes = torch.stack([c for c, _, _ in items])
        scales = torch.stack([s for _, s, _ in items])
        zps = None if any(z is None for _, _, z in items) else torch.stack([z for _, _, z in items])
        return codes, scales, zps

    def interleaved(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
        if a is None or b is None:
            return None
        return torch.stack([a, b], 2).reshape(a.shape[0], 2 * a.shape[1], *a.shape[2:])

    if gated:
        (cg, sg, zg), (cu, su, zu) = stacked(parts("w_gate")), stacked(parts("w_up"))
        fc1 = (interleaved(cg, cu), interleaved(sg, su), interleaved(zg, zu))
    else:
        fc1 = stacked(parts("w_up"))
    fc2 = stacked(parts("w_down"))
    block = group if granularity == "per_group" else None
    return {"bits": bits, "block": block, "fc1": qmoe_tensors(*fc1, bits, block), "fc2": qmoe_tensors(*fc2, bits, block)}


# --- the stand-in -------------------------------------------------------------------------------------

class GraphExperts(nn.Module):
    """A fused experts module as one MoE or QMoE node when torch.onnx exports it (the module docstring); itself
    when run. `quantized`: QMoE's tensors (`quantized_experts`), None for float experts."""

    def __init__(self, module: nn.Module, name: str, arch: Any, quantized: Mapping[str, Any] | None = None,
                 op: ExpertsOp | None = None) -> None:
        super().__init__()
        self._module = (module,)  # not a child: its parameters are not the graph's
        self.name, self.arch, self.quantized = name, arch, quantized
        self.n_experts = _n_experts(module, arch)
        t = _float_tensors(module, arch)
        self.gated = t["fc1"].shape[1] == 2 * t["fc2"].shape[2]
        # found now, not while torch.export traces the forward (which would record the check as graph ops); the
        # top-k is the call's, set when exported
        self.op = op if op is not None else experts_op(module, arch, 1, t)
        for key in ("b1", "b2"):  # the biases stay float in both operators
            self.register_buffer(key, t[key])
        if quantized is None:
            self.register_buffer("fc1", t["fc1"])
            self.register_buffer("fc2", t["fc2"])
        else:
            for fc in ("fc1", "fc2"):
                for part, array in quantized[fc].items():
                    self.register_buffer(f"{fc}_{part}", torch.from_numpy(array))

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        module = self._module[0]
        if not torch.compiler.is_exporting():
            return module(*args, **kwargs)
        first = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
        rows, index, weights = routed_rows(module, args, kwargs)
        index = index.reshape(rows.shape[0], -1)
        op = dataclasses.replace(self.op, k=int(index.shape[1]))
        # an index equal to the number of experts is no expert (transformers' experts skip it: LongCat-Flash's zero
        # experts are handed so): scattered into a column of its own, which is dropped
        zeros = torch.zeros(rows.shape[0], self.n_experts + 1, dtype=rows.dtype, device=rows.device)
        chosen = zeros.scatter(1, index, 1.0)[:, :self.n_experts]
        dense = zeros.scatter(1, index, weights.reshape(rows.shape[0], -1).to(rows.dtype))[:, :self.n_experts]
        attrs = op.attributes()
        meta = {EXPERTS_KEY: self.name}
        if self.quantized is not None:
            q = self.quantized
            attrs.update(expert_weight_bits=int(q["bits"]), **({"block_size": int(q["block"])} if q["block"] else {}))
            inputs = [rows, chosen, self.fc1_weights, self.fc1_scales, self.b1, self.fc2_weights, self.fc2_scales,
                      self.b2, None, None, None, getattr(self, "fc1_zero_points", None),
                      getattr(self, "fc2_zero_points", None), None, dense]
            out = torch.onnx.ops.symbolic("com.microsoft::QMoE", inputs, attrs, dtype=rows.dtype, shape=rows.shape,
                                          version=1, metadata_props=meta)
            return out.reshape(first.shape)
        # MoE weighs by the softmax of its input: the log of each chosen weight (-1e30 elsewhere), renormalised over
        # the chosen by the softmax and scaled back by their sum
        logits = torch.where(chosen > 0, torch.log(dense.clamp_min(_TINY)), torch.full_like(dense, _UNCHOSEN))
        out = torch.onnx.ops.symbolic("com.microsoft::MoE", [rows, logits, self.fc1, self.b1, self.fc2, self.b2],
                                      attrs, dtype=rows.dtype, shape=rows.shape, version=1, metadata_props=meta)
        out = torch.cat([out, rows], dim=-1)[:, :rows.shape[-1]]  # the input read after the node (module docstring)
        return (out * dense.sum(-1, keepdim=True)).reshape(first.shape)


def _experts_modules(model: nn.Module, info: ModelInfo) -> dict[str, nn.Module]:
    """{name: fused experts module} of `info`'s routed layers in `model`."""
    from ..hf.capture import _module_for

    names = [n for n, _ in model.named_modules()]
    out: dict[str, nn.Module] = {}
    for layer in info.layers:
        if layer.expert is not None:
            name, module = _module_for(model, info, layer, names)
            out.setdefault(name, module)
    return out


class ExpertsInGraph:
    """While active, every routed experts module of `model` is a `GraphExperts`: QMoE where `modules` (a planned
    model's ModuleQuants, with `weight_of` giving each one's planned weight) quantize it, float MoE elsewhere.
    Built (and refused: FFNQuantError naming the module) when made, before anything is exported; entering yields
    {module name: what its node stores}. Every module is put back on exit. `like`: another model's stand-ins of
    the same modules (the float model's), whose operators are taken rather than found again."""

    def __init__(self, model: nn.Module, info: ModelInfo, modules: Sequence[ModuleQuant] | None = None,
                 weight_of: Any = None, like: ExpertsInGraph | None = None) -> None:
        self.model = model
        by_module: dict[str, list] = {}
        for mq in modules or ():
            if mq.expert is not None:
                by_module.setdefault(mq.fused, []).append(mq)
        self.stand_ins: dict[str, GraphExperts] = {}
        self.written: dict[str, dict[str, Any]] = {}
        for name, module in _experts_modules(model, info).items():
            why = experts_call_refusal(module, info)
            if why is not None:
                raise FFNQuantError(why)
            quants = by_module.get(name) or []
            quantized = None
            if any(mq.quantized for mq in quants):
                gated = "w_gate" in {mq.weight for mq in quants}
                quantized = quantized_experts(quants, weight_of, info.spec.d_model, info.spec.d_ff, gated)
            known = like.stand_ins.get(name) if like is not None else None
            stand_in = GraphExperts(module, name, info.arch, quantized, known.op if known is not None else None)
            self.stand_ins[name] = stand_in
            op = stand_in.op
            self.written[name] = {
                "op": "QMoE" if quantized else "MoE", "experts": stand_in.n_experts, "activation": op.activation,
                **({"alpha": op.alpha, "beta": op.beta, "limit": op.limit} if op.gated else {}),
                **({"bits": quantized["bits"], "block_size": quantized["block"]} if quantized else {}),
                "recipe": quants[0].recipe if quants else None}
        self._swapped: list = []

    def __enter__(self) -> dict[str, dict[str, Any]]:
        for name, stand_in in self.stand_ins.items():
            parent, _, child = name.rpartition(".")
            owner = self.model.get_submodule(parent) if parent else self.model
            self._swapped.append((owner, child, getattr(owner, child)))
            setattr(owner, child, stand_in)
        return self.written

    def __exit__(self, *exc: Any) -> None:
        for owner, child, original in reversed(self._swapped):
            setattr(owner, child, original)
        self._swapped.clear()
