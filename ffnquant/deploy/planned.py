"""A model quantized as its plan says, as one transformers model plus what each FFN matmul stores.

`build_planned_model` quantizes every planned FFN layer with its recipe (the same path as `quantize --model
--plan`), measures ffnquant's torch reference end to end, and then makes the deployable form of it: a copy
of the float model whose FFN input scales (SmoothQuant, AWQ) are folded into the norms before the FFNs and
whose FFN Linear modules hold ffnquant's dequantized weights (hidden-site smoothing is already in w_up's
rows). Each FFN Linear gets a `ModuleQuant`: its weight grid, how its input is quantized, or that it stays
float. The formats (`deploy.ctensors`, `deploy.onnx_model`) write that; nothing is quantized twice.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn

from ..errors import FFNQuantError
from ..hf import EvalSettings, capture_layer_inputs, end_to_end, load_ffn_layers, quantized_layers
from ..hf.capture import _module_for
from ..hf.routed import expert_forward, expert_weight
from ..methods.fakequant import WEIGHT_INPUT_SITE, SiteRange, WeightGrid
from ..numerics.accuracy import held_rows
from ..numerics.remedies import BlockHadamard
from ..schemes import ActMode, Method, Scheme, get_scheme

if TYPE_CHECKING:  # annotations only
    from ..hf.checkpoint import ModelInfo
    from ..methods.fakequant import QuantizedFFN
    from ..planning.planfile import Plan
    from ..recipe import Recipe

__all__ = ["ModuleQuant", "PlannedModel", "deployable_refusal", "build_planned_model", "loaded_ffn",
           "expert_linear_names"]


@dataclass(frozen=True)
class ModuleQuant:
    """How one FFN Linear of the deployed model is quantized (or that it stays float).

    `grid` is None when the weight stays float (an fp32 layer, a `+float=SITE` matmul); `input_mode` is
    "static" (one calibrated `input_range`), "dynamic" (per token, `scheme.act_*`) or None (float input).
    `rotation` is the orthogonal block-Hadamard the matmul's input is multiplied by first (`+rotate` on the
    hidden site: w_down's columns already carry it), None without one.
    """

    module: str  # full name in the transformers model, e.g. "model.layers.3.mlp.down_proj"
    layer: str  # "L3"
    index: int
    weight: str  # "w_gate", "w_up" or "w_down"
    site: str  # the activation site the matmul reads: "input" or "hidden"
    recipe: str
    scheme: Scheme
    grid: WeightGrid | None
    input_mode: str | None
    input_range: SiteRange | None
    rotation: BlockHadamard | None = None
    # the integer codes on `grid` (signed int32, [out, in] or [out, K'] for groups), as the method handler made them
    # (`QuantizedLinear.codes`): what the writers store, never derived again; None for float and fp8 weights
    codes: torch.Tensor | None = None
    # a routed expert: its id, and the model's fused experts module holding its weight (`module` is then the
    # expert's Linear as the checkpoint names it on disk, e.g. "model.layers.3.mlp.experts.7.gate_proj")
    expert: int | None = None
    fused: str | None = None

    @property
    def quantized(self) -> bool:
        return self.grid is not None or self.input_mode is not None


@dataclass
class PlannedModel:
    """The deployable model: `model` (float32 transformers model, input scales folded, dequantized FFN weights),
    `modules` (a ModuleQuant per FFN Linear, in layer order), the float model it came from, the held-out
    batches and ffnquant's torch reference figures on them (`reference`: `hf.end_to_end`'s result).

    `model` holds weights only: the activation quantization is in `modules` (and `qffns`), and a `+rotate`
    layer's w_down carries the rotation while the Hadamard on its input is `ModuleQuant.rotation`, which a
    format must apply (the ONNX graph does; compressed-tensors refuses such recipes)."""

    info: Any
    plan: Any
    model: nn.Module
    float_model: nn.Module
    modules: list[ModuleQuant]
    evals: list[torch.Tensor]
    reference: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    qffns: dict[str, Any] = field(default_factory=dict)  # label -> QuantizedFFN (input scale folded away)
    settings: dict[str, Any] = field(default_factory=dict)
    # what the deployed model computes in: float_model, evals' figures and qffns are in it (`deploy.precision`);
    # `model` stays float32, exact values the writers compress from
    compute_dtype: torch.dtype = torch.float32
    # the original float model's figures on `evals` (`hf.evaluate.float_reference`'s), kept from the reference's run
    # for the proof to score the loaded folder against, without running the float model again (None: not kept)
    float_references: list | None = None

    def float32_model(self) -> nn.Module:
        """The original float model in float32 (itself when it computes in float32; else a float32 copy, the
        same values): what the fold check compares against float32 rounding."""
        if self.compute_dtype is torch.float32:
            return self.float_model
        return copy.deepcopy(self.float_model).float().eval()

    def references(self) -> list:
        """The original float model's figures on `evals` (`hf.evaluate.float_reference`'s kept batches): those kept
        from the reference's run, else computed now (and kept)."""
        if self.float_references is None:
            from ..hf.evaluate import float_reference

            self.float_references = float_reference(self.float_model, self.info, self.evals)[1]
        return self.float_references

    def by_module(self) -> dict[str, ModuleQuant]:
        return {m.module: m for m in self.modules}

    def weight_of(self, mq: ModuleQuant) -> torch.Tensor:
        """The weight `model` holds for `mq` ([out, in], float32): its Linear's, or a routed expert's rows of
        the fused experts tensors (`hf.routed.expert_weight`)."""
        if mq.expert is None:
            return self.model.get_submodule(mq.module).weight.detach()
        return expert_weight(self.model.get_submodule(mq.fused), mq.expert, mq.weight, self.info.arch).detach()


def deployable_refusal(info: ModelInfo, fmt: str = "compressed-tensors") -> str | None:
    """Why a plan for this model cannot be deployed as one model folder (`fmt` "compressed-tensors") or one graph
    ("onnx") (one line); None when it can."""
    arch = info.arch
    if arch.install is arch.install.EXPERTS:
        if fmt == "onnx":
            # each experts module one onnxruntime MoE/QMoE node (`deploy.onnx_experts`), where its call is one
            if arch.matrix_experts:
                return (f"{info.model_type}: its routed experts are child modules called with the rows sorted by "
                        "expert, not onnxruntime MoE's call of every row with its top-k experts and weights; "
                        "per-layer ONNX artifacts store them")
            from ..onnx.moe import moe_unavailable

            why = moe_unavailable()
            return None if why is None else (f"{info.model_type}: its routed experts are onnxruntime MoE/QMoE nodes in "
                                             f"the whole-model graph, and {why}; per-layer ONNX artifacts store them")
        fused = next((layer for layer in info.layers if layer.fused_expert_tensors), None)
        from .experts import loader_expert_names

        if fused is not None and not loader_expert_names(arch):
            from .expert_loading import WeightConverter

            why = (f"in {arch.experts_class}, which transformers' loader of a compressed-tensors folder replaces by "
                   "per-expert modules that ffnquant does not know how to fill" if WeightConverter is not None else
                   "and this transformers has no conversion ops to read them back from per-expert tensors "
                   "(transformers >= 5 has)")
            return (f"{info.model_type}: its checkpoint stores the routed experts fused ({', '.join(fused.tensors.values())}) "
                    f"{why}, so a compressed-tensors folder of it would not load")
        # experts fused on disk are written per expert with their biases and read back by ffnquant's converters
        # (`expert_loading`); those transformers fuses itself come through its own converters, which carry none
        if info.spec.bias and fused is None:
            return (f"{info.model_type}: its routed experts have biases, which compressed-tensors' per-expert layout "
                    "(transformers' loader of quantized experts) does not carry")
        return None
    if arch.transposed:
        if fmt == "onnx":
            return (f"{info.model_type}: its MLP weights are transformers' Conv1D ([in, out]); the graph's FFN matmuls "
                    "are rewritten from nn.Linear modules; per-layer ONNX artifacts still apply")
        return (f"{info.model_type}: its MLP weights are transformers' Conv1D ([in, out]), which compressed-tensors "
                "does not quantize (it targets nn.Linear); per-layer ONNX artifacts and `quantize --model` still apply")
    if fmt != "onnx" and arch.linear_class not in ("Linear", ""):
        return (f"{info.model_type}: its FFN matrices are {arch.linear_class}, a subclass of nn.Linear that transformers "
                "cannot load back from a compressed-tensors folder (its weight initialisation reads .weight, which "
                "compression replaces)")
    return None


def _linear_names(ffn_module: str, info: ModelInfo) -> dict[str, str]:
    """ffnquant weight name -> full module name of that Linear in the transformers model (a fused gate+up Linear
    is named for both, in the order its rows hold them)."""
    out = {}
    for role, weights in info.arch.roles.items():
        if role in info.arch.needed_roles(info.spec.gated):
            for w in weights.split("+"):
                out[w] = f"{ffn_module}.{role}"
    return out


def loaded_ffn(model: nn.Module, info: ModelInfo, ffn_module: str, expert: int | None = None,
               layer_idx: int | None = None) -> Any:
    """The FFN of a (loaded) transformers model as one callable on [..., d_model]: the module itself, or for
    Linears in the block itself (OPT) the first Linear, the activation and the second in turn; a routed `expert`
    of the fused experts module `ffn_module` (`hf.routed.expert_forward`); called with `layer_idx`, the calling
    layer's index, where its calls compute differently (`ModelInfo.calls_differ`: Zamba 2's shared MLP)."""
    module = model.get_submodule(ffn_module)
    if layer_idx is not None:
        return functools.partial(module, layer_idx=layer_idx)
    if expert is not None:
        if isinstance(module, nn.ModuleList):  # a loader's per-expert modules (Llama 4's from a compressed folder)
            return module[expert]
        return expert_forward(module, expert, info.arch)
    if info.arch.install is info.arch.install.SPLIT:
        first, act, second = (module.get_submodule(a) for a in info.arch.split_attrs)
        return lambda x: second(act(first(x)))
    if info.arch.residual_arg:  # the module adds the block's residual (BLOOM, MPT): a zero one leaves the FFN
        return lambda x: module(x, torch.zeros_like(x))
    return module


def _merge_fused(quants: list[ModuleQuant], names: Mapping[str, str]) -> list[ModuleQuant]:
    """One ModuleQuant per module: a fused gate+up Linear's two halves become one, their grids stacked by rows in
    the module's order. Per-channel and group grids stack exactly (each row keeps its own scale); two halves on
    other terms (a float half, different bits or per-tensor scales that differ) cannot share one module."""
    by_module: dict[str, list[ModuleQuant]] = {}
    for mq in quants:
        by_module.setdefault(mq.module, []).append(mq)
    out = []
    for module, parts in by_module.items():
        if len(parts) == 1:
            out.append(parts[0])
            continue
        order = [w for w, m in names.items() if m == module]
        parts.sort(key=lambda mq: order.index(mq.weight))
        a, b = parts
        same = (a.input_mode, a.input_range, a.rotation is None, b.rotation is None) == \
            (b.input_mode, b.input_range, True, True)
        ga, gb = a.grid, b.grid
        if not same or (ga is None) != (gb is None):
            raise FFNQuantError(f"{module}: its fused halves ({a.weight}, {b.weight}) are quantized differently "
                                f"({a.recipe}); one Linear holds one quantization")
        grid = ga
        if ga is not None:
            if (ga.kind, ga.bits, ga.granularity, ga.symmetric, ga.group_size) != \
                    (gb.kind, gb.bits, gb.granularity, gb.symmetric, gb.group_size) or (
                    ga.scale.dim() == 0 and not torch.equal(ga.scale, gb.scale)):
                raise FFNQuantError(f"{module}: its fused halves have different weight grids ({a.recipe}); one Linear "
                                    "holds one grid (per-tensor scales of gate and up differ)")
            if ga.scale.dim() > 0:
                zp = None if ga.zero_point is None else torch.cat([ga.zero_point, gb.zero_point])
                grid = dataclasses.replace(ga, scale=torch.cat([ga.scale, gb.scale]), zero_point=zp)
        codes = None if a.codes is None or b.codes is None else torch.cat([a.codes, b.codes])
        out.append(dataclasses.replace(a, weight="+".join(mq.weight for mq in parts), grid=grid, codes=codes))
    return out


def _module_quants(label: str, index: int, recipe: Recipe, qffn: QuantizedFFN, names: Mapping[str, str]) -> list[ModuleQuant]:
    scheme = qffn.scheme
    ffn = qffn.model
    rotation = ffn.hidden_transform if isinstance(ffn.hidden_transform, BlockHadamard) else None
    out = []
    for weight in ffn.spec.weight_names:
        site = WEIGHT_INPUT_SITE[weight]
        grid = qffn.weight_grids.get(weight)
        if weight in qffn.quantized_weights and grid is None and not scheme.weight_dtype.is_float:
            raise FFNQuantError(f"layer {label}: recipe {recipe}: {scheme.weight_dtype} weights have no integer or fp8 "
                                "grid (bitsandbytes code books, HQQ's float zero points): no deployment format stores them")
        mode = None
        if site in qffn.quantized_sites and not scheme.act_dtype.is_float:
            mode = "dynamic" if scheme.act_mode is ActMode.DYNAMIC else "static"
        quantized = weight in qffn.quantized_weights
        ql = qffn.linears.get(weight) if quantized else None
        out.append(ModuleQuant(module=names[weight], layer=label, index=index, weight=weight, site=site,
                               recipe=str(recipe), scheme=scheme, grid=grid if quantized else None,
                               input_mode=mode, input_range=qffn.ranges.get(site) if mode == "static" else None,
                               rotation=rotation if site == "hidden" else None,
                               codes=ql.codes if ql is not None and grid is not None and grid.kind == "int" else None))
    return out


def _copy_weights(model: nn.Module, ffn: Any, names: Mapping[str, str]) -> None:
    by_module: dict[str, list[str]] = {}
    for weight, module in names.items():
        by_module.setdefault(module, []).append(weight)  # a fused Linear: its halves in row order
    with torch.no_grad():
        for module, weights in by_module.items():
            srcs, dst = [getattr(ffn, w) for w in weights], model.get_submodule(module)
            weight = torch.cat([s.weight for s in srcs])
            if tuple(dst.weight.shape) != tuple(weight.shape):
                raise FFNQuantError(f"{module}: weight shape {tuple(dst.weight.shape)} in the model, "
                                    f"{tuple(weight.shape)} in ffnquant's FFN")
            dst.weight.copy_(weight.to(dst.weight.dtype))
            if (dst.bias is None) != (srcs[0].bias is None):
                raise FFNQuantError(f"{module}: the model and ffnquant's FFN disagree on the bias")
            if dst.bias is not None:
                dst.bias.copy_(torch.cat([s.bias for s in srcs]).to(dst.bias.dtype))


def expert_linear_names(info: ModelInfo, layer: Any) -> dict[str, str]:
    """ffnquant weight name -> the routed expert's Linear as its checkpoint names it on disk (the tensor name less
    ".weight", e.g. "model.layers.3.mlp.experts.7.gate_proj"): what compressed-tensors stores it under."""
    from .experts import loader_expert_names

    if layer.fused_expert_tensors:  # stored fused: written per expert (`expert_loading`, Llama 4's loader)
        return {w: f"{layer.name}.{layer.expert}.{proj}" for w, proj in loader_expert_names(info.arch).items()}
    out = {}
    for role, name in layer.tensors.items():
        base, _, kind = role.rpartition(".")
        if kind == "weight" and info.arch.roles.get(base) in ("w_gate", "w_up", "w_down"):
            out[info.arch.roles[base]] = name.rsplit(".", 1)[0]
    return out


def _expert_quants(model: nn.Module, info: ModelInfo, layer: Any, ffn_module: str, recipe: Recipe,
                   qffn: QuantizedFFN) -> list[ModuleQuant]:
    """A routed expert's dequantized weights put into its rows of the model's fused experts tensors, and one
    ModuleQuant per weight under the expert's on-disk Linear names (`expert_linear_names`)."""
    names = expert_linear_names(info, layer.info)
    wanted = set(qffn.model.spec.weight_names)
    if set(names) != wanted:
        raise FFNQuantError(f"layer {layer.label}: the checkpoint names {sorted(names)} of the expert's projections, "
                            f"its FFN has {sorted(wanted)}")
    fused = model.get_submodule(ffn_module)
    with torch.no_grad():
        for weight in names:
            dst, src = expert_weight(fused, layer.info.expert, weight, info.arch), getattr(qffn.model, weight).weight
            if tuple(dst.shape) != tuple(src.shape):
                raise FFNQuantError(f"{ffn_module}: expert {layer.info.expert}'s {weight} is {tuple(dst.shape)} in "
                                    f"the model, {tuple(src.shape)} in ffnquant's FFN")
            dst.copy_(src.to(dst.dtype))
    return [dataclasses.replace(mq, expert=layer.info.expert, fused=ffn_module)
            for mq in _module_quants(layer.label, layer.index, recipe, qffn, names)]


def build_planned_model(info: ModelInfo, plan: Plan, *, text: Any = None, eval_text: Any = None, calib_tokens: int | None = None,
                        seq_len: int | None = None,
                        eval_tokens: int | None = None, whole_model: bool = True, out_artifacts: Any = None,
                        file_stem: str | None = None, progress: Any = None,
                        dtype: torch.dtype = torch.float32, fmt: str | None = None) -> PlannedModel:
    """Quantize `info`'s FFN layers as `plan` says and make the deployable model (see the module docstring).

    Every layer of the model must be in the plan (an fp32 recipe keeps one float). Raises FFNQuantError, before
    anything is computed, for a model deployment does not cover (`deployable_refusal`) or whose norms cannot
    take a planned input scale (`hf.fold.fold_refusal`). With `whole_model` False only the layers are quantized
    and measured (`model` is the float model, `modules` empty: per-layer artifacts of any plannable model).
    `out_artifacts`: also write each layer's ONNX artifact there (`<file_stem>.<label>.<slug>.onnx`).
    `dtype`: what the deployed model computes in. In a low precision (bf16 for a bf16 checkpoint), the model runs
    in it on the engine, each layer is quantized as usual on its (float32) inputs, and each quantized FFN then
    computes as the runtime does in that dtype (`deploy.precision.in_dtype`: scales rounded to it, codes kept):
    the reference is measured so. `fmt`: the format it is built for, whose refusal of the model is checked
    (default: compressed-tensors for routed experts, onnx otherwise)."""
    from ..hf.fold import fold_input_scales, fold_refusal

    # a format's own refusals are checked by its caller too
    experts = info.arch.install is info.arch.install.EXPERTS
    why = deployable_refusal(info, fmt or ("compressed-tensors" if experts else "onnx")) if whole_model else None
    if why is not None:
        raise FFNQuantError(why)
    missing = [layer.index for layer in info.layers if layer.index not in plan.layers]
    if missing:
        raise FFNQuantError(f"the plan has no recipe for layer(s) {', '.join(map(str, missing))}: a deployed model needs "
                            "one for every layer (fp32 keeps a layer float)")
    # smoothing and AWQ put a scale on the FFN input that must fold into the norm before it
    smoothed = [i for i, r in plan.layers.items() if r.smooth is not None or get_scheme(r.scheme).method is Method.AWQ]
    if whole_model and smoothed and fold_refusal(info) is not None:
        raise FFNQuantError(f"layers {', '.join(f'L{i}' for i in smoothed)}: {fold_refusal(info)}")
    budget = {k: v for k, v in (("max_calib_tokens", calib_tokens), ("max_eval_tokens", eval_tokens),
                                ("seq_len", seq_len)) if v is not None}
    settings = EvalSettings(**budget, ablation=False)  # None: EvalSettings' defaults
    # a plan whose recipes read no calibration text (weight-only rounding, per-token activations) quantizes to the
    # same model whatever the text: one sequence of it runs, for the range tables, not the whole budget
    reads = any(r.reads_calibration for r in plan.layers.values())
    if not reads:
        calib_tokens = settings.seq_len
        settings = dataclasses.replace(settings, max_calib_tokens=calib_tokens)
    layers = load_ffn_layers(info, "all")
    inputs = capture_layer_inputs(info, layers, text=text, eval_text=eval_text, calib_tokens=calib_tokens,
                                  eval_tokens=eval_tokens, settings=settings, progress=progress, dtype=dtype,
                                  references=True)
    # each layer's held-out SQNR (a row of the report; the proof runs end to end) on evenly strided rows, as the plan
    # scores its candidates (`numerics.accuracy.HELD_ROWS`): the quantizers never read them
    inputs.eval = {label: held_rows(x) for label, x in inputs.eval.items()}
    rows, qffns = quantized_layers(info, layers, inputs, plan, onnx=out_artifacts is not None, sensitivity=False,
                                   out_artifacts=out_artifacts, file_stem=file_stem, progress=progress)
    if dtype is not torch.float32:
        from .precision import in_dtype_all

        qffns = in_dtype_all(qffns, dtype)
    kept: list = []  # the float model's figures on the held-out batches, for the proof (`float_references`)
    # the float figures from the capture's own run of the held-out text, so only the quantized model runs here
    reference = end_to_end(inputs.model, info, layers, qffns, inputs.eval_batches, settings, progress=progress,
                           engine=inputs.engine, keep=kept, references=inputs.float_references,
                           baseline=inputs.float_baseline)
    kept_refs = kept if len(kept) == len(inputs.eval_batches) else None
    float_model = inputs.model
    settings_used = {"calibration": inputs.calibration_source, "evaluation": inputs.evaluation_source,
                     "calib_tokens": calib_tokens, "eval_tokens": eval_tokens, "token_budgets": inputs.budgets,
                     "calibration_read": reads}
    if not whole_model:
        return PlannedModel(info=info, plan=plan, model=float_model, float_model=float_model, modules=[],
                            evals=list(inputs.eval_batches), reference=reference, rows=rows, qffns=qffns,
                            settings=settings_used, compute_dtype=dtype, float_references=kept_refs)
    model = copy.deepcopy(float_model).float().eval()  # float32: a low-precision model's values, exactly
    by_label = {layer.label: layer for layer in layers}
    folded = fold_input_scales(model, info, {by_label[k].info: q for k, q in qffns.items()})
    names = [n for n, _ in model.named_modules()]
    modules: list[ModuleQuant] = []
    out_qffns: dict[str, Any] = {}
    for layer in layers:
        qffn = folded[layer.info]
        ffn_module = _module_for(model, info, layer.info, names)[0]
        recipe = plan.recipe_for(layer.index)
        if layer.info.expert is not None:
            modules += _expert_quants(model, info, layer, ffn_module, recipe, qffn)
        else:
            linear = _linear_names(ffn_module, info)
            _copy_weights(model, qffn.model, linear)
            modules += _merge_fused(_module_quants(layer.label, layer.index, recipe, qffn, linear), linear)
        out_qffns[layer.label] = qffn
    return PlannedModel(info=info, plan=plan, model=model, float_model=float_model, modules=modules,
                        evals=list(inputs.eval_batches), reference=reference, rows=rows, qffns=out_qffns,
                        settings=settings_used, compute_dtype=dtype, float_references=kept_refs)
