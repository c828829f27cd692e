"""One model's FFN layers quantized and measured, whichever way their inputs were captured: range tables
(`calibrate_layers`), each layer under a recipe or its plan's (`quantize_layers`, `quantized_layers`), and the
end-to-end figures' layout from their accumulators (`end_to_end_figures`, `model_layers_report`). The engine's
commands (`hf.layerwise`) and the whole-forward path (`hf.evaluate`) both assemble their results here.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from ..errors import FFNQuantError
from ..methods.fakequant import input_hessians
from ..numerics.observe import profile
from ..quantization import quantize_recipes
from .checkpoint import HFLayer, ModelInfo
from .inputs import EvalSettings, LayerInputs, model_file_stem
from .metrics import _NLL, Agreement, ErrorStats


def is_plan(recipe: Any) -> bool:
    """True for a per-layer plan (`planning.Plan`: a recipe per layer index), False for one recipe. Read from the
    object, so this engine does not import the planning package that builds on it."""
    return callable(getattr(recipe, "recipe_for", None))

__all__ = ["calibrate_layers", "calls_differ", "check_recipes_per_call", "end_to_end_figures", "is_plan",
           "model_layers_report", "quantize_layers", "quantized_layers"]

Progress = Callable[[str, int, int], None]  # (message, done, total): called here, shown by the commands


def calibrate_layers(
    layers: Sequence[HFLayer], captured: Iterable[Mapping[str, torch.Tensor]], bins: int = 2048, hessians: bool = False
) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """RangeTables (every site) per layer label from captured input batches; optionally GPTQ Hessians.

    An expert the router never chose gets the merged table of its layer's other experts
    (same spec), marked in `meta["borrowed_from_layer"]`.
    """
    by_label = {layer.label: layer for layer in layers}
    tables: dict[str, Any] = {}
    hess: dict[str, dict[str, torch.Tensor]] = {}
    for batch in captured:
        for label, x in batch.items():
            if label not in by_label or x.shape[0] == 0:
                continue
            ffn = by_label[label].ffn
            table = profile(ffn, [x], bins=bins, weights=label not in tables)
            if by_label[label].block is not None:  # the model's own block arithmetic, for claims about it
                table.meta = dict(table.meta, model_block=dict(by_label[label].block))
            tables[label] = tables[label].merge(table) if label in tables else table
            if hessians:
                h = input_hessians(ffn, [x])
                hess[label] = {k: hess[label][k] + v for k, v in h.items()} if label in hess else h
    for layer in layers:
        if layer.label in tables:
            continue
        siblings = [tables[o.label] for o in layers if o.index == layer.index and o.label in tables]
        if not siblings:
            raise FFNQuantError(f"layer {layer.label} ({layer.name}) received no calibration tokens")
        merged = siblings[0]
        for t in siblings[1:]:
            merged = merged.merge(t)
        from ..numerics.observe import weight_stats

        merged.weights = {n: weight_stats(w, bins) for n, w in layer.ffn.weights().items()}
        merged.meta = dict(merged.meta, borrowed_from_layer=layer.index)
        tables[layer.label] = merged
        if hessians:
            sib = [hess[o.label] for o in layers if o.index == layer.index and o.label in hess]
            hess[layer.label] = {k: sum(h[k] for h in sib) for k in sib[0]}
    return tables, hess


def quantize_layers(
    layers: Sequence[HFLayer],
    recipes: Sequence[Any],
    inputs: LayerInputs,
    *,
    file_stem: str | None = None,
    collect_errors: bool = False,
    out_artifacts: str | os.PathLike | None = None,
    onnx: bool = False,
    baseline: bool = False,
    sensitivity: bool = False,
    latency: bool = False,
    bins: int | None = None,
    smooth_sites: Sequence[str] | None = None,
):
    """THE way a real model's FFN layers are quantized: yield a `quantization.RecipeOutcome` (its `label` set)
    per layer and recipe, layer by layer (recipes in order within a layer).

    Each layer is quantized exactly as a synthetic variant (`quantization.quantize_recipes`): one `prepare` per
    remedy set on the layer's FFN with its captured calibration inputs `inputs.calib[label]` (remedies
    applied to the layer, ranges re-profiled with `bins`), `quantize_spec` per recipe measured on the
    held-out `inputs.eval[label]`. ONNX files (with `onnx` and `out_artifacts`) are named
    `<file_stem>.<label>.<recipe slug>.onnx` (`file_stem` default: the layer label alone). Layers that call one FFN
    (its weights shared, `LayerInfo.root`) are quantized once, on all their calibration and held-out rows, each then
    given an outcome holding that one result. Used by the
    `ffnquant model eval` command (`evaluate_model`, `evaluate_layers_from_files`), `ffnquant quantize
    --model` (`quantize_model_layers`) and `ffnquant run`. `collect_errors`: see `quantize_recipes`.
    """
    calls_of = _calls(layers)
    for calls in calls_of.values():
        if calls_differ(calls):
            per_call_refusal([c.label for c in calls], recipes)
    done: dict[tuple[int, int | None], list[Any]] = {}
    merged: dict[tuple[int, int | None], Any] = {}  # an FFN whose calls differ: every call's statistics, merged
    for layer in layers:
        calls = calls_of[layer.info.root]
        if calls_differ(calls):  # each call through its own FFN, from every call's statistics: one quantization
            yield from _per_call(layer, calls, recipes, inputs, done, merged, file_stem, dict(
                collect_errors=collect_errors, out_artifacts=out_artifacts, onnx=onnx, baseline=baseline,
                sensitivity=sensitivity, latency=latency, bins=bins, smooth_sites=smooth_sites))
            continue
        if layer is not calls[0]:  # an FFN called again (its weights shared): the first call's quantization, as it is
            for first in done[layer.info.root]:
                yield dataclasses.replace(first, label=layer.label)
            continue
        name = f"{file_stem}.{layer.label}" if file_stem else layer.label
        calib, held_out = (_pooled(calls, inputs.calib), _pooled(calls, inputs.eval)) if len(calls) > 1 else (
            inputs.calib[layer.label], inputs.eval[layer.label])
        outcomes = done.setdefault(layer.info.root, []) if len(calls) > 1 else None
        for outcome in quantize_recipes(
            layer.spec, recipes, collect_errors=collect_errors, out_artifacts=out_artifacts, onnx=onnx,
            baseline=baseline, sensitivity=sensitivity, latency=latency, model=layer.ffn,
            calib_tokens=calib, eval_tokens=held_out, name=name, bins=bins, smooth_sites=smooth_sites,
        ):
            outcome.label = layer.label
            if outcomes is not None:
                outcomes.append(outcome)
            yield outcome
        del calib, held_out


def calls_differ(calls: Sequence[Any]) -> bool:
    """Whether the layers calling one FFN (its weights shared) compute different functions with it: its model's
    own middle is passed the calling layer's index (Zamba 2's MLP adds each call's own adapter of its input)."""
    return len(calls) > 1 and getattr(calls[0].ffn.activation, "layer_idx", None) is not None


def merges_across_calls(recipe: Any) -> bool:
    """Whether a recipe's calibration is statistics that every call's own merge into (`_per_call`): static ranges
    from one range table (a calibrator of the histograms; not `search`, which quantizes trial models on rows) and
    GPTQ's Hessians (summed); not a transform computed from data (smoothing) nor AWQ's scale search."""
    from ..recipe import Recipe
    from ..schemes import Method

    recipe = Recipe.parse(str(recipe))
    if not recipe.reads_calibration:
        return True
    scheme = recipe.resolve()
    return not (any(t.reads_data for t in recipe.transforms) or scheme.method is Method.AWQ
                or (scheme.static_activations and scheme.calibrator == "search"))


def per_call_refusal(labels: Sequence[str], recipes: Sequence[Any]) -> None:
    """Raise for the recipes whose calibration does not merge across calls (`merges_across_calls`), given to the
    layers `labels` calling one FFN that computes differently per call: its one quantization would need them
    computed on every call's rows through that call's own function at once."""
    bad = [str(r) for r in recipes if not merges_across_calls(r)]
    if bad:
        raise FFNQuantError(
            f"recipe {', '.join(bad)} computes from the calibration rows themselves (smoothing, AWQ or the search "
            f"calibrator), and layers {', '.join(labels)} call one FFN (its weights shared) each with its own "
            f"adapters: ffnquant merges only range histograms and GPTQ's Hessians across calls that compute "
            f"differently; valid there: static ranges of a histogram calibrator (e.g. w8a8, w8a8@mse), GPTQ "
            f"(e.g. w4a16-g32-gptq), weight-only or per-token recipes (e.g. w4a16-g32, w8a8-dynamic-s8), or fp32")


def check_recipes_per_call(info: ModelInfo, recipes: Sequence[Any]) -> None:
    """`per_call_refusal` for every FFN of `info` whose calls differ (`ModelInfo.calls_differ`), before any weight
    is read."""
    if info.calls_differ():
        for group in info.shared_groups():
            per_call_refusal([f"L{i}" for i in group], recipes)


def _per_call(layer: HFLayer, calls: Sequence[HFLayer], recipes: Sequence[Any], inputs: LayerInputs,
              done: dict[tuple[int, int | None], list[Any]], merged: dict[tuple[int, int | None], Any],
              file_stem: str | None, kw: Mapping[str, Any]) -> Iterable[Any]:
    """One call of an FFN whose calls differ, quantized through its own FFN (its own adapters) and measured on its
    own held-out rows, from the calibration statistics of every call, each through its own FFN, merged
    (`_merged_statistics`): every call then rounds to the same weights and ranges, which is checked bit for bit
    (one set of weights is what the model stores)."""
    name = f"{file_stem}.{layer.label}" if file_stem else layer.label
    root = layer.info.root
    if root not in merged:
        merged[root] = _merged_statistics(calls, recipes, inputs, kw.get("bins"))
    table, hessians = merged[root]
    firsts = done.get(root)
    outcomes = list(quantize_recipes(layer.spec, recipes, model=layer.ffn, calib_tokens=inputs.calib[layer.label],
                                     eval_tokens=inputs.eval[layer.label], name=name, profiles={(): table},
                                     hessians=hessians, **kw))
    for k, outcome in enumerate(outcomes):
        outcome.label = layer.label
        q = outcome.result.qmodel if outcome.result is not None else None
        first = firsts[k].result.qmodel if firsts and firsts[k].result is not None else None
        if q is not None and first is not None:
            mine, theirs = q.model.weights(), first.model.weights()
            if any(not torch.equal(mine[n], theirs[n]) for n in mine) or q.ranges != first.ranges:
                raise FFNQuantError(f"layer {layer.label}: quantizing the FFN it shares with {calls[0].label} under "
                                    f"{outcome.recipe} gave other weights or ranges than that layer's: one set "
                                    "cannot be stored for both")
    if firsts is None:
        done[root] = outcomes
    yield from outcomes


def _merged_statistics(calls: Sequence[HFLayer], recipes: Sequence[Any], inputs: LayerInputs,
                       bins: int | None) -> tuple[Any, dict[str, torch.Tensor] | None]:
    """The calibration statistics of an FFN whose calls differ, every call's rows through that call's own FFN:
    (the range table of its input and hidden sites, merged; GPTQ's Hessians, summed, where a recipe needs them).
    A recipe with remedies is refused before (`merges_across_calls`), so these are the plain FFN's."""
    from ..quantization import calibration_batches, site_profile
    from ..recipe import Recipe

    table, hessians = None, None
    gptq = any(not r.is_float and r.resolve().needs_hessians for r in (Recipe.parse(str(x)) for x in recipes))
    for call in calls:
        rows = inputs.calib[call.label]
        mine = site_profile(call.ffn, rows, bins)
        table = mine if table is None else table.merge(mine)
        if gptq:
            h = input_hessians(call.ffn, calibration_batches(rows))
            hessians = h if hessians is None else {k: hessians[k] + v for k, v in h.items()}
    return table, hessians


def _calls(layers: Sequence[HFLayer]) -> dict[tuple[int, int | None], list[HFLayer]]:
    """`layers` by the FFN they call (`LayerInfo.root`), in order: one list per FFN, several layers where its
    weights are shared (Zamba's), in the order of each FFN's first call."""
    groups: dict[tuple[int, int | None], list[HFLayer]] = {}
    for layer in layers:
        groups.setdefault(layer.info.root, []).append(layer)
    return groups


def _pooled(calls: Sequence[HFLayer], tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Every call's rows of one shared FFN, in the calls' order (a call not selected, or without rows, adds none)."""
    parts = [tensors[c.label] for c in calls if c.label in tensors and tensors[c.label].numel()]
    return torch.cat(parts) if parts else tensors[calls[0].label]


def _worst(rows: list[dict[str, Any]], key: str, reverse: bool, n: int = 3) -> list[str]:
    valid = [r for r in rows if r.get(key) is not None]
    return [r["label"] for r in sorted(valid, key=lambda r: r[key], reverse=reverse)[:n]]


def end_to_end_figures(baseline: Mapping[str, Any], hidden: ErrorStats, nll: _NLL | None,
                       ablated: Mapping[int, tuple[ErrorStats, _NLL | None]],
                       agreement: Agreement | None = None) -> dict[str, Any]:
    """`end_to_end`'s result from its accumulators: the final hidden state's errors (`hidden`), the quantized
    model's next-token loss (`nll`, None for models without perplexity), its agreement with the float model's
    next-token distributions (`agreement`: the perplexity change's interval, KL, top-1) and, per layer index
    quantized alone, the same first two (`ablated`). The one layout of these figures, whichever path streamed
    the batches."""
    ablation = []
    for i, (abl_hidden, abl_nll) in sorted(ablated.items()):
        a = {"index": i, "label": f"L{i}", "hidden_sqnr_db": abl_hidden.sqnr_db, "hidden_cosine": abl_hidden.cosine}
        if abl_nll is not None:
            ppl = abl_nll.perplexity
            a["perplexity"] = ppl
            a["perplexity_delta"] = ppl - baseline["perplexity"]
        ablation.append(a)
    e2e: dict[str, Any] = {"hidden_sqnr_db": hidden.sqnr_db, "hidden_cosine": hidden.cosine}
    if nll is not None:
        ppl = nll.perplexity
        e2e.update(perplexity=ppl, perplexity_delta=ppl - baseline["perplexity"],
                   perplexity_ratio=ppl / baseline["perplexity"])
    if agreement is not None and agreement.count:
        fig = agreement.figures()
        fig.pop("perplexity_ratio_paired")  # the same ratio as perplexity_ratio (same tokens), kept once
        e2e.update(fig)
    if ablation and nll is not None:
        worst = _worst(ablation, "perplexity_delta", reverse=True)
    else:
        worst = _worst(ablation, "hidden_sqnr_db", reverse=False)
    return {"baseline": dict(baseline), "end_to_end": e2e, "ablation": ablation, "worst_layers_end_to_end": worst}


def quantized_layers(
    info: ModelInfo,
    layers: Sequence[HFLayer],
    inputs: LayerInputs,
    recipe: Any,
    *,
    smooth_sites: Sequence[str] | None = None,
    out_artifacts: str | os.PathLike | None = None,
    onnx: bool = True,
    latency: bool = False,
    sensitivity: bool = True,
    file_stem: str | None = None,
    progress: Progress | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each FFN of `layers` quantized under one `recipe`, or each under its own when `recipe` is a `plan.Plan`:
    (a JSON-able row per layer, {label: QuantizedFFN}). The rows are `quantize_layers`' results with the
    layer's name, index and seconds; `progress(message, done, total)` after each layer."""
    info.check_selection({layer.index for layer in layers})
    stem = file_stem or model_file_stem(info)
    by_label = {layer.label: layer for layer in layers}
    rows, qffns = [], {}
    plan = recipe if is_plan(recipe) else None  # each layer its own recipe
    kw = dict(file_stem=stem, out_artifacts=out_artifacts, onnx=onnx, baseline=onnx, sensitivity=sensitivity,
              latency=latency, smooth_sites=smooth_sites)
    if plan is not None:
        # the calls of one shared FFN together, under its first call's recipe (a plan gives them one:
        # `planning.Plan.check_model`)
        outcomes = (o for calls in _calls(layers).values()
                    for o in quantize_layers(calls, [plan.recipe_for(calls[0].index)], inputs, **kw))
    else:
        outcomes = quantize_layers(layers, [recipe], inputs, **kw)
    # the calls of an FFN whose calls differ (Zamba 2's adapters), each quantized on its own inputs
    own_inputs = {layer.label for calls in _calls(layers).values() if calls_differ(calls) for layer in calls[1:]}
    t_layer = time.perf_counter()
    for outcome in outcomes:
        layer, res = by_label[outcome.label], outcome.result
        data = res.to_dict()
        data.pop("environment", None)  # once per report, not per layer
        now = time.perf_counter()
        shares = layer.info.shares
        per_call = {"own_inputs": True} if layer.label in own_inputs else {}
        rows.append({"label": layer.label, "index": layer.index, "expert": layer.expert, "name": layer.name,
                     "inputs_borrowed": inputs.borrowed.get(layer.label), "seconds": now - t_layer, **data,
                     **({"shares": f"L{shares}", **per_call} if shares is not None else {})})
        t_layer = now
        qffns[layer.label] = res.qmodel
        del outcome, res
        if progress is not None:
            progress(f"quantize layers: {layer.label}", len(rows), len(layers))
    return rows, qffns


def model_layers_report(info: ModelInfo, recipe: Any, rows: Sequence[Mapping[str, Any]], e2e: Mapping[str, Any],
                        settings: EvalSettings, inputs: LayerInputs) -> dict[str, Any]:
    """What `quantize --model` reports: the model, the recipe (or the plan), the texts and their budgets from
    `inputs`, a row per layer and the end-to-end figures. The one layout, whichever path quantized the layers."""
    if is_plan(recipe):  # the header names the plan; each layer row carries its own recipe
        head = {"recipe": "per-layer plan", "plan": recipe.to_dict(),
                "scheme": {"name": f"plan ({len({str(r) for r in recipe.layers.values()})} recipes)"},
                "calibrator": None, "remedies": []}
    else:
        head = {k: rows[0][k] for k in ("recipe", "scheme", "calibrator", "remedies")}
    return {
        "model": {k: v for k, v in info.to_dict().items() if k != "layers"},
        "ablation": settings.ablation,
        **head,
        "calibration": {"source": _with_shortfall(inputs.calibration_source, inputs.budgets.get("calibration")),
                        "tokens_per_layer": {r["label"]: r["n_calib_tokens"] for r in rows},
                        "tokens": inputs.budgets.get("calibration")},
        "evaluation": {"source": _with_shortfall(inputs.evaluation_source, inputs.budgets.get("evaluation")),
                       "separation": inputs.separation,
                       "tokens_per_layer": {r["label"]: r["n_eval_tokens"] for r in rows},
                       "tokens": inputs.budgets.get("evaluation")},
        "layers": list(rows),
        "worst_layers_sqnr": _worst([{"label": r["label"], "sqnr_db": r["accuracy_torch"]["sqnr_db"]} for r in rows],
                                    "sqnr_db", reverse=False),
        "end_to_end": dict(e2e),
    }


def _with_shortfall(source: str, budget: Mapping[str, Any] | None) -> str:
    """`source`, followed by requested against obtained tokens when the text gave fewer than requested."""
    if not budget or not budget.get("short"):
        return source
    return (f"{source} (gives {budget['obtained']:,} of the {budget['requested']:,} tokens requested: "
            "the text is too short)")


