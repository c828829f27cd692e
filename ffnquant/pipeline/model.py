"""Stage: a real model's FFN layers side by side with the variants (captured inputs, every recipe per
layer, every recipe end to end, latency of one representative layer)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..errors import FFNQuantError
from ..hf import (EvalSettings, calibrate_layers, capture_layer_inputs, end_to_end, float_baseline, inspect_model,
                  load_ffn_layers, model_file_stem, parse_layers)
from ..hf.capture import check_tokenizer, require_transformers
from ..infra.render import display_path
from ..recipe import Recipe
from .latency import LatencySettings, measure_latency
from .results import ModelPart, Progress, Stages
from .variants import Scoring, score_recipes

if TYPE_CHECKING:  # annotations only
    from ..hf.checkpoint import ModelInfo

__all__ = ["MODEL_E2E_MAX_BYTES", "ModelSettings", "check_model", "model_layers"]

# Quantized copies of every FFN layer under every recipe are kept for the end-to-end model runs;
# past this many bytes the run leaves the end-to-end numbers out (and says so) rather than swap.
MODEL_E2E_MAX_BYTES = 2 << 30


@dataclass(frozen=True)
class ModelSettings:
    """What the model stage reads of a run's config: the model folder, its layers ('0-3', '0,5,7'; None = all),
    the calibration and evaluation texts (None = the shipped samples), an optional plan file, and the token
    counts, histogram bins and batch size of the calibration."""

    model: str
    layers: str | None
    text: str | None
    eval_text: str | None
    plan: str | None
    calib_tokens: int
    eval_tokens: int
    bins: int
    batch_size: int

    def __post_init__(self) -> None:
        if min(self.calib_tokens, self.eval_tokens, self.bins, self.batch_size) <= 0:
            raise FFNQuantError(f"model settings need positive token counts, bins and batch size, got {self!r}")


def check_model(settings: ModelSettings) -> tuple[Any, list[int]]:
    """The model folder of `settings` inspected (config.json, weights, architecture), its layer selection
    parsed, transformers and both texts checked: every model error fails before the run starts."""
    info = inspect_model(settings.model)
    indices = parse_layers(settings.layers, info.n_layers)
    info.check_selection(indices)
    if settings.plan is not None:
        from ..planning import load_plan

        missing = sorted(set(indices) - set(load_plan(settings.plan, info).layers))
        if missing:
            raise FFNQuantError(f"plan {settings.plan} has no recipe for layer(s) {', '.join(map(str, missing))} of the "
                                "selected layers")
    require_transformers()
    # reads both texts and checks the tokenizer's ids against config.json's vocab_size: a tokenizer
    # that does not belong to the weights fails here, not after the synthetic variants have run
    check_tokenizer(info, {"calibration": settings.text, "evaluation": settings.eval_text})
    return info, indices


def model_layers(
    settings: ModelSettings, scoring: Scoring, timing: LatencySettings, info: ModelInfo, recipes: Sequence[Recipe],
    out_export: Path | None, runtimes: Sequence[tuple], tick: Callable[..., None], progress: Progress | None,
    stages: Stages,
) -> ModelPart:
    """The real model's selected FFN layers, treated as variants keyed '<model_type>:<label>': range tables
    from inputs captured on the calibration text, every recipe quantized per layer on held-out inputs
    from the evaluation text (artifacts `<model>.<label>.<recipe slug>.onnx`), every quantized recipe put
    back into the model (end to end), and the latency of the first selected layer on the runtimes."""
    t0 = time.perf_counter()
    layers = load_ffn_layers(info, settings.layers)
    evals = EvalSettings(max_calib_tokens=settings.calib_tokens, max_eval_tokens=settings.eval_tokens, bins=settings.bins)
    inputs = capture_layer_inputs(info, layers, text=settings.text, eval_text=settings.eval_text,
                                  calib_tokens=settings.calib_tokens, eval_tokens=settings.eval_tokens, settings=evals)
    keys = {layer.label: f"{info.model_type}:{layer.label}" for layer in layers}
    bs = settings.batch_size
    chunks = ({layer.label: x[i : i + bs]} for layer in layers for x in [inputs.calib[layer.label]]
              for i in range(0, x.shape[0], bs))
    by_label, _ = calibrate_layers(layers, chunks, settings.bins)
    tables = {keys[label]: table for label, table in by_label.items()}
    stages.add("model capture and profile", time.perf_counter() - t0)
    tick(f"{info.model_type}: inputs captured and profiled")

    t0 = time.perf_counter()
    stem = model_file_stem(info)
    quantized = [r for r in recipes if r.name != scoring.baseline]
    e2e_bytes = 4 * sum(layer.spec.n_params for layer in layers) * len(quantized)
    e2e_reason = None
    if e2e_bytes > MODEL_E2E_MAX_BYTES:
        e2e_reason = (f"would keep {e2e_bytes / 2**30:.1f} GiB of quantized FFN copies (limit "
                      f"{MODEL_E2E_MAX_BYTES / 2**30:.0f} GiB): select fewer layers or schemes")
    kept: dict[str, dict[str, Any]] = {}
    rows: list[dict] = []
    artifacts: list[dict] = []
    baselines: list[dict] = []
    rep_paths: dict[str, Path] = {}
    for n, layer in enumerate(layers):
        res = score_recipes(layer.spec, layer.ffn, recipes, scoring, inputs.calib[layer.label], inputs.eval[layer.label],
                               out_export, tick, label=keys[layer.label], stem=f"{stem}.{layer.label}",
                               keep=e2e_reason is None)
        for r in res.rows:
            r["layer"] = layer.label
        rows += res.rows
        artifacts += res.artifacts
        if res.ort_baseline is not None:
            baselines.append(res.ort_baseline)
        if e2e_reason is None:
            kept[layer.label] = res.kept
        if n == 0:
            rep_paths = res.paths
    stages.add("model quantize and export", time.perf_counter() - t0)

    skipped: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["status"] != "ok":
            entry = skipped.setdefault(r["scheme"], {"scheme": r["scheme"], "reason": r["reason"] or r["status"], "layers": []})
            entry["layers"].append(r["layer"])

    t0 = time.perf_counter()
    e2e = _end_to_end(info, layers, inputs, evals, quantized, kept, e2e_reason, settings.plan)
    kept.clear()
    tick(f"{info.model_type}: end to end")
    stages.add("model end to end", time.perf_counter() - t0)

    # --- latency of one representative layer (all layers share the spec: same shapes, same kernels) ---
    rep = layers[0]
    latency: dict[str, Any] = {"layer": None, "reason": None, "cases": [], "runtimes": []}
    if timing.none or not runtimes:
        latency["reason"] = "no runtimes requested (runtimes = none)" if timing.none else "no runtime is available"
    else:
        t0 = time.perf_counter()
        ok = {r["scheme"] for r in rows if r["layer"] == rep.label and r["status"] == "ok"}
        v = rep.spec.variant.value
        section = measure_latency(timing, [rep.spec], [r for r in recipes if r.name in ok], {v: rep.ffn},
                                  {(v, name): p for name, p in rep_paths.items()}, runtimes, [], progress)
        for c in section["cases"]:
            c["variant"] = keys[rep.label]
        latency.update(layer=keys[rep.label], cases=section["cases"], runtimes=section["runtimes"],
                       reason=f"{keys[rep.label]} stands for every layer: the {len(layers)} selected layers share one "
                              f"spec ({rep.spec.key}), so the same shapes run the same kernels"
                              + (f"; {section['reason']}" if section.get("reason") else ""))
        stages.add("model latency", time.perf_counter() - t0)

    doc = _model_doc(info, layers, keys, inputs, stem, skipped, e2e, latency)
    return ModelPart(doc, tables, rows, artifacts, baselines, latency)


def _end_to_end(info: ModelInfo, layers: Sequence[Any], inputs: Any, settings: Any, quantized: Sequence[Recipe],
                kept: dict[str, dict[str, Any]], reason: str | None, plan_file: str | None = None) -> dict[str, Any]:
    """Every layer quantized with the same recipe, back in the model, on the held-out text; then, with a plan
    file, every layer with its planned recipe (row 'plan: FILE')."""
    e2e: dict[str, Any] = {"status": "ok", "reason": None, "evaluation_text": inputs.evaluation_source,
                           "baseline": None, "schemes": []}
    if reason is not None:
        e2e.update(status="missing", reason=reason)
        return e2e
    e2e["baseline"] = float_baseline(inputs.model, info, inputs.eval_batches, engine=inputs.engine)
    for recipe in quantized:
        qffns = {label: k.get(recipe.name) for label, k in kept.items()}
        if any(q is None for q in qffns.values()):
            continue  # not applicable to this model (listed under skipped)
        try:
            qffns.update(_shared_quantized(info, layers, inputs, recipe))
        except FFNQuantError as exc:  # a recipe one FFN's calls cannot share (Zamba 2's, calibrated from the rows)
            e2e.setdefault("skipped", []).append({"scheme": recipe.name, "reason": str(exc)})
            continue
        res = end_to_end(inputs.model, info, layers, qffns, inputs.eval_batches, settings, e2e["baseline"],
                         engine=inputs.engine)
        e2e["schemes"].append({"scheme": recipe.name, "label": recipe.label, "end_to_end": res["end_to_end"],
                               "ablation": res["ablation"], "worst_layers_end_to_end": res["worst_layers_end_to_end"]})
    if plan_file is not None:
        from ..planning import load_plan
        from ..planning.candidates import quantize_layer

        plan = load_plan(plan_file, info)
        qffns = {}
        for layer in layers:
            recipe = plan.recipe_for(layer.index)
            q = kept.get(layer.label, {}).get(recipe.name)
            if q is None and not recipe.is_float:
                q = quantize_layer(layer, recipe, inputs.calib[layer.label], inputs.eval[layer.label], settings.bins)[0]
            if q is not None:
                qffns[layer.label] = q
        qffns.update(_shared_quantized(info, layers, inputs, plan))
        res = end_to_end(inputs.model, info, layers, qffns, inputs.eval_batches, settings, e2e["baseline"],
                         engine=inputs.engine)
        name = f"plan: {display_path(plan_file)}"
        e2e["schemes"].append({"scheme": name, "label": f"{name} ({len(set(map(str, plan.layers.values())))} recipes)",
                               "end_to_end": res["end_to_end"], "ablation": res["ablation"],
                               "worst_layers_end_to_end": res["worst_layers_end_to_end"],
                               "plan": {str(i): str(r) for i, r in plan.layers.items()}})
    return e2e


def _shared_quantized(info: ModelInfo, layers: Sequence[Any], inputs: Any, recipe: Any) -> dict[str, Any]:
    """The layers calling one FFN (its weights shared) as the model deploys them: one quantization of it from every
    call's rows (`hf.layers.quantize_layers`; through each call's own FFN where the calls differ), not each call's
    own as the per-layer table scores it. `recipe`: one, or a plan (each group under its first call's)."""
    from ..hf.layers import is_plan, quantized_layers

    shared = {i for calls in info.shared_groups() for i in calls}
    chosen = [layer for layer in layers if layer.index in shared
              and not (recipe.recipe_for(layer.index) if is_plan(recipe) else recipe).is_float]
    if not chosen:
        return {}
    return quantized_layers(info, chosen, inputs, recipe, onnx=False, sensitivity=False)[1]


def _model_doc(info: ModelInfo, layers: Sequence[Any], keys: dict[str, str], inputs: Any, stem: str,
               skipped: dict[str, dict], e2e: dict[str, Any], latency: dict[str, Any]) -> dict[str, Any]:
    """The report's `model` section."""
    doc = {
        "status": "ok" if not skipped and e2e["status"] == "ok" else "partial",
        "reason": None,
        "path": display_path(info.path),
        "model_type": info.model_type,
        "kind": info.kind.value,
        "variant": info.spec.variant.value,
        "activation": info.spec.activation.value,
        "hf_activation": info.hf_activation,
        "spec": info.spec.to_dict(),
        "spec_key": info.spec.key,
        "n_layers": info.n_layers,
        "n_experts": info.n_experts,
        "n_ffns": len(info.layers),
        "file_stem": stem,
        "layers": [{"key": keys[l.label], "label": l.label, "index": l.index, "expert": l.expert, "name": l.name,
                    "calib_tokens": int(inputs.calib[l.label].shape[0]), "eval_tokens": int(inputs.eval[l.label].shape[0]),
                    "inputs_borrowed": inputs.borrowed.get(l.label)} for l in layers],
        # requested against obtained tokens of each text: a short text is said, never silently shrunk
        "calibration": {"source": inputs.calibration_source, "tokens": inputs.budgets.get("calibration")},
        "evaluation": {"source": inputs.evaluation_source, "separation": inputs.separation,
                       "tokens": inputs.budgets.get("evaluation")},
        "skipped": list(skipped.values()),
        "end_to_end": e2e,
        "latency": {"layer": latency["layer"], "reason": latency["reason"]},
    }
    if skipped:
        doc["reason"] = "; ".join(f"{s['scheme']} skipped: {s['reason']}" for s in skipped.values())
    elif e2e["status"] != "ok":
        doc["reason"] = f"end to end not measured: {e2e['reason']}"
    return doc
