"""Calibrate a real model's FFNs on captured inputs and measure what quantizing them costs end to end.

Calibration streams each captured batch through the layer's ffnquant FFN with observers on
every site (issue 3's `observe.profile`, merged batch by batch), so memory is one batch.
`quantize_layers` is the one way layers are quantized (each exactly as a synthetic variant:
`quantization.quantize_recipes` on the layer's captured inputs, `hf.inputs`). Evaluation puts the
quantized FFNs (torch reference numerics) back into the transformers model and measures what its user notices: perplexity on the
evaluation text for causal LMs, SQNR and cosine of the final hidden states for every kind
(the only end-to-end measure for encoders and encoder-decoders), next to each layer's own
output SQNR on the same captured inputs, and, per layer, the end-to-end cost of quantizing
that layer alone (which layers hurt most).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from ..errors import FFNQuantError
from .arch import ModelKind
from .capture import (
    ffn_input_hooks, install_ffns, iter_captured, iter_captured_files, load_hf_model, load_tokenizer, model_text_batches,
)
from .checkpoint import HFLayer, ModelInfo, inspect_model, load_ffn_layers
from .metrics import Agreement, ErrorStats, Reference, _NLL, _final_hidden, _run, reference_batch
from .inputs import (  # re-exported: hf.evaluate is where they were
    EvalSettings, LayerInputs, capture_layer_inputs, file_inputs, fit_settings, model_file_stem, token_budget,
)

__all__ = [
    "EvalSettings",
    "ErrorStats",
    "calibrate_layers",
    "calibrate_model",
    "quantize_layers",
    "evaluate_layers_from_files",
    "evaluate_model",
    "float_baseline",
    "float_reference",
    "end_to_end",
    "LayerInputs",
    "capture_layer_inputs",
    "quantize_model_layers",
    "model_file_stem",
    "fit_settings",
]

Progress = Callable[[str, int, int], None]  # (message, done, total): called here, shown by the commands


def calibrate_layers(
    layers: Sequence[HFLayer], captured: Iterable[Mapping[str, torch.Tensor]], bins: int = 2048, hessians: bool = False
) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """RangeTables (every site) per layer label from captured input batches; optionally GPTQ Hessians.

    An expert the router never chose gets the merged table of its layer's other experts
    (same spec), marked in `meta["borrowed_from_layer"]`.
    """
    from ..observe import profile
    from ..fakequant import input_hessians

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
        from ..observe import weight_stats

        merged.weights = {n: weight_stats(w, bins) for n, w in layer.ffn.weights().items()}
        merged.meta = dict(merged.meta, borrowed_from_layer=layer.index)
        tables[layer.label] = merged
        if hessians:
            sib = [hess[o.label] for o in layers if o.index == layer.index and o.label in hess]
            hess[layer.label] = {k: sum(h[k] for h in sib) for k in sib[0]}
    return tables, hess


def _file_batches(source: str | os.PathLike, layers: Sequence[HFLayer], d_model: int):
    labels = [layer.label for layer in layers]
    for label, x in iter_captured_files(source, labels, d_model):
        yield {label: x}


def calibrate_model(
    path: str | os.PathLike | ModelInfo,
    layers: str | int | list[int] | None = "all",
    text: str | os.PathLike | None = None,
    captured: str | os.PathLike | None = None,
    settings: EvalSettings = EvalSettings(),
    allow_pickle: bool = False,
) -> tuple[list[HFLayer], dict[str, Any]]:
    """The selected FFN layers of a model folder and a RangeTable per layer (label -> table).

    Inputs come from running the model on `text` (default: the shipped calibration sample;
    needs transformers) or, when `captured` is given, from files saved by `ffnquant model
    capture` (<label>.npy / .safetensors per layer, or one .safetensors keyed by label).
    """
    info = path if isinstance(path, ModelInfo) else inspect_model(path, allow_pickle=allow_pickle)
    hf_layers = load_ffn_layers(info, layers, allow_pickle=allow_pickle)
    if captured is not None:
        batches = _file_batches(captured, hf_layers, info.spec.d_model)
        meta: dict[str, Any] = {"source_label": f"captured activations {captured}"}
    else:
        from .capture import text_label

        settings = fit_settings(info, settings)
        # tokenized (and the ids checked against config.json) before the model is loaded
        ids = model_text_batches(info, load_tokenizer(info.path), text, "calibration", settings.seq_len,
                                 settings.batch_size, settings.max_calib_tokens)
        label = text_label(text, "calibration")
        meta = {"source_label": f"text {label}",
                "calibration_text": token_budget("calibration", settings.max_calib_tokens, ids, label)}
        model = load_hf_model(info, allow_pickle=allow_pickle)
        batches = iter_captured(model, info, [layer.info for layer in hf_layers], ids)
    tables, _ = calibrate_layers(hf_layers, batches, settings.bins)
    for table in tables.values():  # what each layer was measured on: the text, requested and obtained tokens
        table.meta = dict(table.meta, **meta)
    return hf_layers, tables


def evaluate_layers_from_files(
    path: str | os.PathLike | ModelInfo,
    schemes: Sequence[Any],
    calib_captured: str | os.PathLike,
    eval_captured: str | os.PathLike,
    layers: str | int | list[int] | None = "all",
    calibrator: str | None = None,
    bins: int = 2048,
    allow_pickle: bool = False,
) -> dict[str, Any]:
    """Per-layer SQNR/cosine per recipe from captured activation files; needs no transformers.

    `schemes`: Recipes or their text (`w8a8@mse+smooth`); `calibrator` applies to those of them with static
    activation ranges and no calibrator of their own. The end-to-end numbers need the model itself
    (`evaluate_model`); here they are absent.
    """
    info = path if isinstance(path, ModelInfo) else inspect_model(path, allow_pickle=allow_pickle)
    hf_layers = load_ffn_layers(info, layers, allow_pickle=allow_pickle)
    recipes = _recipes(schemes, calibrator)
    inputs = file_inputs(info, hf_layers, calib_captured, eval_captured)
    by_label = {layer.label: layer for layer in hf_layers}
    results, skipped = [], []
    for recipe, qffns in _quantized_per_recipe(hf_layers, info, recipes, inputs, bins, skipped):
        scheme = recipe.resolve()
        stats = {label: ErrorStats() for label in by_label}
        with torch.no_grad():
            for batch in _file_batches(eval_captured, hf_layers, info.spec.d_model):
                for label, x in batch.items():
                    stats[label].update(by_label[label].ffn(x), qffns[label](x))
        rows = [{"label": l.label, "index": l.index, "expert": l.expert, "name": l.name,
                 "sqnr_db": stats[l.label].sqnr_db, "cosine": stats[l.label].cosine,
                 "n_eval_tokens": stats[l.label].n_tokens, "calib_tokens": int(inputs.calib[l.label].shape[0]),
                 "calib_borrowed": l.label in inputs.calib_borrowed} for l in hf_layers]
        results.append({"scheme": scheme.name, "recipe": recipe.name, "scheme_spec": scheme.to_dict(),
                        "end_to_end": None, "layers": rows, "ablation": [],
                        "worst_layers_sqnr": _worst(rows, "sqnr_db", reverse=False), "worst_layers_end_to_end": []})
    return {"model": info.to_dict(), "calibrator": calibrator, "calibration_captured": str(calib_captured),
            "evaluation_captured": str(eval_captured), "schemes": results, "skipped": skipped,
            "end_to_end_unavailable": "captured activations only: end-to-end numbers need the model run (evaluate_model)"}


def _recipes(schemes: Sequence[Any], calibrator: str | None) -> list[Any]:
    """Recipes from `schemes` (Recipes or text); `calibrator` given to each static one without its own."""
    from ..recipe import Recipe, as_recipe

    out = []
    for s in schemes:
        r = as_recipe(s)
        if calibrator is not None and r.calibrator is None and r.resolve().static_activations:
            r = Recipe(r.scheme, calibrator, r.smooth, r.rotate)
        out.append(r)
    if not out:
        raise FFNQuantError("no schemes to evaluate")
    return out


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
    `<file_stem>.<label>.<recipe slug>.onnx` (`file_stem` default: the layer label alone). Used by the
    `ffnquant model eval` command (`evaluate_model`, `evaluate_layers_from_files`), `ffnquant quantize
    --model` (`quantize_model_layers`) and `ffnquant run`. `collect_errors`: see `quantize_recipes`.
    """
    from ..quantization import quantize_recipes

    for layer in layers:
        name = f"{file_stem}.{layer.label}" if file_stem else layer.label
        for outcome in quantize_recipes(
            layer.spec, recipes, collect_errors=collect_errors, out_artifacts=out_artifacts, onnx=onnx,
            baseline=baseline, sensitivity=sensitivity, latency=latency, model=layer.ffn,
            calib_tokens=inputs.calib[layer.label], eval_tokens=inputs.eval[layer.label], name=name, bins=bins,
            smooth_sites=smooth_sites,
        ):
            outcome.label = layer.label
            yield outcome


def _quantized_per_recipe(hf_layers, info, recipes, inputs, bins, skipped):
    """(recipe, {label: QuantizedFFN}) for each recipe that fits the model, one recipe at a time (one set of
    quantized copies in memory); the others go to `skipped` with why."""
    for recipe in recipes:
        try:
            recipe.check_fits(info.spec)
        except FFNQuantError as exc:
            skipped.append({"scheme": recipe.name, "reason": str(exc)})
            continue
        qffns = {o.label: o.result.qmodel for o in quantize_layers(hf_layers, [recipe], inputs, bins=bins)}
        yield recipe, qffns


def _worst(rows: list[dict[str, Any]], key: str, reverse: bool, n: int = 3) -> list[str]:
    valid = [r for r in rows if r.get(key) is not None]
    return [r["label"] for r in sorted(valid, key=lambda r: r[key], reverse=reverse)[:n]]


def float_baseline(model: Any, info: ModelInfo, evals: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The float model on the evaluation batches: perplexity (causal LMs, else None) and the token count."""
    return float_reference(model, info, evals, keep=False)[0]


def float_reference(model: Any, info: ModelInfo, evals: Sequence[torch.Tensor],
                    keep: bool = True) -> tuple[dict[str, Any], list[Reference] | None]:
    """The float model run once on the evaluation batches: (`float_baseline`'s figures, and with `keep` one
    `Reference` per batch (next-token NLL, top-k log-probabilities, final hidden state) so that every later
    candidate is scored without running the float model again)."""
    nll = _NLL()
    refs: list[Reference] | None = [] if keep else None
    causal = info.kind is ModelKind.CAUSAL_LM
    for ids in evals:
        out = _run(model, info, ids)
        if causal:
            nll.update(out.logits, ids)
        if refs is not None:
            hidden = _final_hidden(info, out)
            refs.append(reference_batch(out.logits if causal else None, ids, hidden))
        del out
    return {"perplexity": nll.perplexity, "n_tokens": sum(int(b.numel()) for b in evals)}, refs


def end_to_end(
    model: Any,
    info: ModelInfo,
    layers: Sequence[HFLayer],
    qffns: Mapping[str, Any],
    evals: Sequence[torch.Tensor],
    settings: EvalSettings = EvalSettings(),
    baseline: Mapping[str, Any] | None = None,
    per_layer: dict[str, ErrorStats] | None = None,
    progress: Progress | None = None,
    references: Sequence[Reference] | None = None,
) -> dict[str, Any]:
    """What the model's user notices when each FFN in `qffns` (label -> callable on [tokens, d_model], e.g. a
    QuantizedFFN built with remedies) replaces the model's own: final hidden SQNR/cosine, perplexity and its
    change with a 95% interval, the next-token KL divergence and top-1 agreement against the float model for
    causal LMs, and with `settings.ablation` the same per layer index quantized alone.

    `evals`: token-id batches of the evaluation text; `baseline`: `float_baseline` of the same batches
    (computed when None); `references`: `float_reference`'s kept batches, so the float model is not run again
    (it still runs when `per_layer` needs its FFN inputs); `per_layer`: ErrorStats by label, fed each FFN's own
    output error on the inputs captured during the float runs. Returns {"baseline", "end_to_end", "ablation",
    "worst_layers_end_to_end"}. `progress(message, done, total)`: after each evaluation batch ('end to end:
    batch 2/7') and each ablation run ('ablation: L4, batch 2/7').
    """
    baseline = dict(baseline) if baseline is not None else float_baseline(model, info, evals)
    by_label = {layer.label: layer for layer in layers}
    layer_infos = [layer.info for layer in layers]
    indices = sorted({by_label[k].index for k in qffns})
    causal = info.kind is ModelKind.CAUSAL_LM
    ablate = settings.ablation and len(indices) > 1
    hidden_all, nll_all, agreement = ErrorStats(), _NLL(), Agreement()
    ablate_hidden = {i: ErrorStats() for i in indices}
    ablate_nll = {i: _NLL() for i in indices}
    n_ablation = len(evals) * len(indices) if ablate else 0
    for b, ids in enumerate(evals):
        ref = references[b] if references is not None else None
        if per_layer is not None:
            captured: dict[str, list[torch.Tensor]] = {}
            with ffn_input_hooks(model, info, layer_infos, lambda l, x: captured.setdefault(l.label, []).append(x)):
                out_ref = _run(model, info, ids)  # the float run, capturing each FFN's input on the way
            with torch.no_grad():
                for label, xs in captured.items():
                    for x in xs:
                        if x.shape[0] and label in qffns:
                            per_layer[label].update(by_label[label].ffn(x), qffns[label](x))
            del captured
        elif ref is None:
            out_ref = _run(model, info, ids)
        if ref is None:
            ref = reference_batch(out_ref.logits if causal else None, ids, _final_hidden(info, out_ref))
            del out_ref
        with install_ffns(model, info, {by_label[k].info: q for k, q in qffns.items()}):
            out = _run(model, info, ids)
        hidden_all.update(ref.hidden, _final_hidden(info, out))
        if causal:
            nll_all.update(out.logits, ids)
            agreement.update(ref, out.logits, ids)
        del out
        if progress is not None:
            progress(f"end to end: batch {b + 1}/{len(evals)}", b + 1, len(evals))
        if ablate:
            for j, i in enumerate(indices):
                only = {by_label[k].info: q for k, q in qffns.items() if by_label[k].index == i}
                with install_ffns(model, info, only):
                    out_i = _run(model, info, ids)
                ablate_hidden[i].update(ref.hidden, _final_hidden(info, out_i))
                if causal:
                    ablate_nll[i].update(out_i.logits, ids)
                if progress is not None:
                    progress(f"ablation: L{i}, batch {b + 1}/{len(evals)}", b * len(indices) + j + 1, n_ablation)
    return end_to_end_figures(baseline, hidden_all, nll_all if causal else None,
                              {i: (ablate_hidden[i], ablate_nll[i] if causal else None) for i in indices} if ablate else {},
                              agreement if causal else None)


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
    from ..plan.planfile import Plan

    stem = file_stem or model_file_stem(info)
    by_label = {layer.label: layer for layer in layers}
    rows, qffns = [], {}
    plan = recipe if isinstance(recipe, Plan) else None  # each layer its own recipe
    kw = dict(file_stem=stem, out_artifacts=out_artifacts, onnx=onnx, baseline=onnx, sensitivity=sensitivity,
              latency=latency, smooth_sites=smooth_sites)
    if plan is not None:
        outcomes = (o for layer in layers for o in quantize_layers([layer], [plan.recipe_for(layer.index)], inputs, **kw))
    else:
        outcomes = quantize_layers(layers, [recipe], inputs, **kw)
    t_layer = time.perf_counter()
    for outcome in outcomes:
        layer, res = by_label[outcome.label], outcome.result
        data = res.to_dict()
        data.pop("environment", None)  # once per report, not per layer
        now = time.perf_counter()
        rows.append({"label": layer.label, "index": layer.index, "expert": layer.expert, "name": layer.name,
                     "inputs_borrowed": inputs.borrowed.get(layer.label), "seconds": now - t_layer, **data})
        t_layer = now
        qffns[layer.label] = res.qmodel
        del outcome, res
        if progress is not None:
            progress(f"quantize layers: {layer.label}", len(rows), len(layers))
    return rows, qffns


def quantize_model_layers(
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
    settings: EvalSettings = EvalSettings(),
    file_stem: str | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Quantize each FFN of `layers` under one `recipe` (`quantize_layers`), or each under its own recipe when
    `recipe` is a `plan.Plan`, then measure end to end.

    Per layer: the `QuantResult` of `quantize_layers` (ONNX artifact `<file_stem>.<label>.<slug>.onnx` in
    `out_artifacts`, onnxruntime's default quantize_static next to it, on the held-out inputs). Then, when
    `inputs` carry the model run, every quantized FFN goes back into the model (`end_to_end`). Returns
    JSON-able data (what `ffnquant quantize --model` reports). `progress(message, done, total)`: after each
    layer ('quantize layers: L3') and each end-to-end batch and ablation run (`end_to_end`); nothing prints.
    With `settings.ablation` False the per-layer end-to-end runs are skipped.
    """
    rows, qffns = quantized_layers(info, layers, inputs, recipe, smooth_sites=smooth_sites, out_artifacts=out_artifacts,
                                   onnx=onnx, latency=latency, sensitivity=sensitivity, file_stem=file_stem,
                                   progress=progress)
    e2e: dict[str, Any]
    if inputs.model is None or not inputs.eval_batches:
        e2e = {"status": "missing", "reason": "inputs came from captured files: the end-to-end numbers need the model "
                                              "itself run on the evaluation text (leave out --captured; needs transformers)"}
    else:
        t_e2e = time.perf_counter()
        e2e = {"status": "ok", "reason": None, "evaluation_text": inputs.evaluation_source,
               **end_to_end(inputs.model, info, layers, qffns, inputs.eval_batches, settings, progress=progress)}
        e2e["seconds"] = time.perf_counter() - t_e2e
    return model_layers_report(info, recipe, rows, e2e, settings, inputs)


def model_layers_report(info: ModelInfo, recipe: Any, rows: Sequence[Mapping[str, Any]], e2e: Mapping[str, Any],
                        settings: EvalSettings, inputs: LayerInputs) -> dict[str, Any]:
    """What `quantize --model` reports: the model, the recipe (or the plan), the texts and their budgets from
    `inputs`, a row per layer and the end-to-end figures. The one layout, whichever path quantized the layers."""
    from ..plan.planfile import Plan

    if isinstance(recipe, Plan):  # the header names the plan; each layer row carries its own recipe
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


def evaluate_model(
    path: str | os.PathLike | ModelInfo,
    schemes: Sequence[Any],
    layers: str | int | list[int] | None = "all",
    calib_text: str | os.PathLike | None = None,
    eval_text: str | os.PathLike | None = None,
    settings: EvalSettings = EvalSettings(),
    calibrator: str | None = None,
    allow_pickle: bool = False,
) -> dict[str, Any]:
    """Quantize the selected FFN layers of a local HF model under each scheme and measure the damage.

    Calibration text and evaluation text default to the two shipped public-domain samples
    (different books). Returns a JSON-able dict: model, settings, float baseline, and per
    scheme the end-to-end numbers, the per-layer SQNR/cosine, the per-layer ablation
    (that layer alone quantized) and the layers that hurt most; a scheme that does not fit
    the model (e.g. a group size not dividing d_model) is listed under `skipped` with why.
    """
    t0 = time.perf_counter()
    info = path if isinstance(path, ModelInfo) else inspect_model(path, allow_pickle=allow_pickle)
    hf_layers = load_ffn_layers(info, layers, allow_pickle=allow_pickle)
    recipes = _recipes(schemes, calibrator)
    settings = fit_settings(info, settings)
    # tokenized (and the ids checked against config.json) before the model is loaded; each FFN's calibration
    # and held-out inputs captured from the model run on the two texts
    inputs = capture_layer_inputs(info, hf_layers, text=calib_text, eval_text=eval_text,
                                  calib_tokens=settings.max_calib_tokens, eval_tokens=settings.max_eval_tokens,
                                  settings=settings, allow_pickle=allow_pickle)
    model, evals = inputs.model, inputs.eval_batches

    baseline = float_baseline(model, info, evals)
    results, skipped = [], []
    for recipe, qffns in _quantized_per_recipe(hf_layers, info, recipes, inputs, settings.bins, skipped):
        scheme = recipe.resolve()
        per_layer = {layer.label: ErrorStats() for layer in hf_layers}
        e2e = end_to_end(model, info, hf_layers, qffns, evals, settings, baseline, per_layer)
        rows = []
        for layer in hf_layers:
            st = per_layer[layer.label]
            row = {"label": layer.label, "index": layer.index, "expert": layer.expert, "name": layer.name,
                   "sqnr_db": st.sqnr_db, "cosine": st.cosine, "n_eval_tokens": st.n_tokens,
                   "calib_tokens": int(inputs.calib[layer.label].shape[0]),
                   "calib_borrowed": layer.label in inputs.calib_borrowed}
            rows.append(row)
        results.append({
            "scheme": scheme.name,
            "recipe": recipe.name,
            "scheme_spec": scheme.to_dict(),
            "end_to_end": e2e["end_to_end"],
            "layers": rows,
            "ablation": e2e["ablation"],
            "worst_layers_sqnr": _worst(rows, "sqnr_db", reverse=False),
            "worst_layers_end_to_end": e2e["worst_layers_end_to_end"],
        })
    return {
        "model": info.to_dict(),
        "settings": settings.to_dict(),
        "calibrator": calibrator,
        "calibration_text": _with_shortfall(inputs.calibration_source, inputs.budgets.get("calibration")),
        "evaluation_text": _with_shortfall(inputs.evaluation_source, inputs.budgets.get("evaluation")),
        "token_budgets": inputs.budgets,
        "calibration_tokens": sum(int(b.numel()) for b in inputs.calib_batches or []),
        "baseline": baseline,
        "schemes": results,
        "skipped": skipped,
        "seconds": time.perf_counter() - t0,
    }
