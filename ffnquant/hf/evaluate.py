"""Calibrate a real model's FFNs on captured inputs and measure what quantizing them costs end to end.

Calibration streams each captured batch through the layer's ffnquant FFN with observers on
every site (`observe.profile`, merged batch by batch), so memory is one batch.
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
from typing import Any, Callable, Mapping, Sequence

import torch

from ..errors import FFNQuantError
from ..recipe import as_recipe
from .arch import ModelKind
from .capture import (ffn_input_hooks, install_ffns, iter_captured, iter_captured_files, load_hf_model, load_tokenizer,
                      model_text_batches)
from .checkpoint import HFLayer, ModelInfo, inspect_model, load_ffn_layers, parse_layers
from .inputs import (EvalSettings, LayerInputs, file_inputs,  # re-exported: hf.evaluate is where they were
                     fit_settings, model_file_stem, token_budget)
from .layers import (_with_shortfall, _worst, calibrate_layers,  # re-exported: hf.evaluate is where they were
                     check_recipes_per_call, end_to_end_figures, model_layers_report, quantize_layers,
                     quantized_layers)
from .layerwise import capture_layer_inputs, end_to_end_layerwise
from .metrics import _NLL, Agreement, ErrorStats, Reference, _final_hidden, _run, reference_batch

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
    info.check_selection(parse_layers(layers, info.n_layers))
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
    from dataclasses import replace

    out = []
    for s in schemes:
        r = as_recipe(s)
        if calibrator is not None and r.calibrator is None and r.resolve().static_activations:
            r = replace(r, calibrator=calibrator)  # every other part of the recipe kept (+float=SITE, remedies)
        out.append(r)
    if not out:
        raise FFNQuantError("no schemes to evaluate")
    return out


def _quantized_per_recipe(hf_layers, info, recipes, inputs, bins, skipped):
    """(recipe, {label: QuantizedFFN}) for each recipe that fits the model, one recipe at a time (one set of
    quantized copies in memory); the others go to `skipped` with why."""
    for recipe in recipes:
        try:
            recipe.check_fits(info.spec)
            check_recipes_per_call(info, [recipe])
        except FFNQuantError as exc:
            skipped.append({"scheme": recipe.name, "reason": str(exc)})
            continue
        qffns = {o.label: o.result.qmodel for o in quantize_layers(hf_layers, [recipe], inputs, bins=bins)}
        yield recipe, qffns


def float_baseline(model: Any, info: ModelInfo, evals: Sequence[torch.Tensor], engine: Any = None) -> dict[str, Any]:
    """The float model on the evaluation batches: perplexity (causal LMs, else None) and the token count; through
    `engine` (`LayerInputs.engine`) when the inputs were captured by one."""
    if engine is not None:
        return end_to_end_layerwise(engine, [], {}, evals)["baseline"]
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
    engine: Any = None,
    keep: list | None = None,
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

    `engine`: the causal LM's `hf.stream.SequentialModel` (`LayerInputs.engine`): the same figures, its decoder
    layers run in turn (`hf.layerwise.end_to_end_layerwise`); `model`'s whole forward runs encoders. `keep` (with
    an engine): a list that gets each batch's float `Reference` (`float_reference`'s), for later scorings.
    """
    if engine is not None:
        return end_to_end_layerwise(engine, layers, qffns, evals, settings, baseline, per_layer, progress, references,
                                    keep=keep)
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
            agreement.update(ref, out.logits, ids, nll_into=nll_all)
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
               **end_to_end(inputs.model, info, layers, qffns, inputs.eval_batches, settings, progress=progress,
                            engine=inputs.engine)}
        e2e["seconds"] = time.perf_counter() - t_e2e
    return model_layers_report(info, recipe, rows, e2e, settings, inputs)


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
    info.check_selection(parse_layers(layers, info.n_layers))
    hf_layers = load_ffn_layers(info, layers, allow_pickle=allow_pickle)
    recipes = _recipes(schemes, calibrator)
    settings = fit_settings(info, settings)
    # tokenized (and the ids checked against config.json) before the model is loaded; each FFN's calibration
    # and held-out inputs captured from the model run on the two texts
    inputs = capture_layer_inputs(info, hf_layers, text=calib_text, eval_text=eval_text,
                                  calib_tokens=settings.max_calib_tokens, eval_tokens=settings.max_eval_tokens,
                                  settings=settings, allow_pickle=allow_pickle)
    model, evals = inputs.model, inputs.eval_batches

    baseline = float_baseline(model, info, evals, engine=inputs.engine)
    results, skipped = [], []
    for recipe, qffns in _quantized_per_recipe(hf_layers, info, recipes, inputs, settings.bins, skipped):
        scheme = recipe.resolve()
        per_layer = {layer.label: ErrorStats() for layer in hf_layers}
        e2e = end_to_end(model, info, hf_layers, qffns, evals, settings, baseline, per_layer, engine=inputs.engine)
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
