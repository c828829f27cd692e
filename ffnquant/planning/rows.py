"""A plan's rows per layer: which candidates the objective can never choose or a fold refuses, each layer's probe fit
(kappa, rho) on its probes' ablations, each candidate's predicted damage and cost (`job.make_plan` reads them)."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Mapping, Sequence

import torch

from ..hf.evaluate import calibrate_layers
from ..hf.layers import merges_across_calls
from ..infra.device import current_device
from ..methods.fakequant import quantized_ffn_to
from ..recipe import Recipe
from ..schemes import Method, get_scheme
from . import candidates
from .candidates import generalization
from .floor import static_int8
from .moe import MoELayer, moe_table, weight_bytes
from .scores import CandidateScore
from .search import Option, pareto
from .sensitivity import fisher_noise
from .steering import min_gain
from .target import Objective

__all__ = ["calibration_exclude", "candidate_row", "choosable", "finish_layer", "fold_exclude", "layer_local", "needs_fold", "never_chosen"]


def _fit(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope through the origin of measured against predicted (>= 0)."""
    num = sum(m * p for p, m in points)
    den = sum(p * p for p, m in points)
    return max(0.0, num / den) if den > 0 else 0.0


def never_chosen(recipes: Sequence[Recipe], latency: Mapping[str, Mapping[str, Any]], where: str) -> dict[str, str]:
    """The candidates the latency objective can never choose, by recipe text, with why: those not timed, and those
    not measurably faster than fp32, which costs no accuracy. "Measurably": by more than the table's own resolution
    (`steering.min_gain`: twice the median relative standard error of its medians, at least MIN_GAIN) and by more
    than twice the standard error of the difference of the two medians (each row's `median_rel_se`: a noisy fp32
    row resolves less than the table does). A candidate timed within that of fp32 is not known to be faster (at
    about 95%), so it would spend accuracy on a saving the table cannot show; and whether noise put it a hair under
    or over fp32 must not decide whether the plan scores it (a deferred GPTQ/AWQ candidate costs seconds per layer).
    Not scoring them changes no plan that this table can tell apart."""
    base = latency.get("fp32") or {}
    fp32 = base.get("p50_ms")
    needed = min_gain(latency)
    out = {}
    for recipe in recipes:
        if recipe.is_float:
            continue
        lat = latency.get(str(recipe)) or {}
        ms = lat.get("p50_ms")
        if ms is None:
            out[str(recipe)] = lat.get("reason") or "not timed"
        elif fp32 is not None and ms >= fp32:
            out[str(recipe)] = (f"no faster than fp32 on {where} ({ms:.2f} ms against {fp32:.2f} ms), which costs no "
                                "accuracy: never chosen, so not scored")
        elif fp32 is not None:
            spread = 2.0 * math.hypot((base.get("median_rel_se") or 0.0) * fp32, (lat.get("median_rel_se") or 0.0) * ms)
            margin = max(fp32 * needed, spread)
            if fp32 - ms <= margin:
                out[str(recipe)] = (f"not measurably faster than fp32 on {where} ({ms:.2f} ms against {fp32:.2f} ms: "
                                    f"{1.0 - ms / fp32:.1%} less, within the table's resolution of {margin / fp32:.1%}"
                                    "), which costs no accuracy: never chosen, so not scored")
    return out


def needs_fold(recipe: Recipe) -> bool:
    """Whether a recipe puts a scale on the FFN input that deployment folds into the norm before the FFN."""
    return recipe.smooth is not None or get_scheme(recipe.scheme).method is Method.AWQ


def fold_exclude(rows: list[dict[str, Any]], refusal: str | None) -> None:
    """A recipe whose input scale cannot fold on this layer is not chosen: no deployment could store it."""
    _exclude(rows, refusal, lambda r: needs_fold(Recipe.parse(r)), "its input scale cannot fold into a norm here")


def calibration_exclude(rows: list[dict[str, Any]], refusal: str | None) -> None:
    """A recipe whose calibration does not merge across calls (`hf.layers.merges_across_calls`: smoothing, AWQ, the
    search calibrator) is not chosen on a layer calling an FFN whose calls differ (Zamba 2's adapters, `refusal`
    says so)."""
    _exclude(rows, refusal, lambda r: not merges_across_calls(r), "it computes from the calibration rows themselves")


def _exclude(rows: list[dict[str, Any]], refusal: str | None, applies: Any, why: str) -> None:
    """Each scored row not yet excluded whose recipe `applies(recipe)` marked excluded, `why` and the layer's
    `refusal` said; nothing where the layer has no refusal."""
    if not refusal:
        return
    for row in rows:
        if row.get("error") is None and "excluded" not in row and applies(str(row["recipe"])):
            row["excluded"] = f"{why}: {refusal}"


def choosable(scores: Sequence[CandidateScore], latency: Mapping[str, Mapping[str, Any]], objective: Objective,
              damage_kind: str, fold_refusal: str | None, calibration_refusal: str | None = None) -> set[str]:
    """The recipes a plan could still choose on a layer from its scores alone: the Pareto front of (damage, cost),
    once over all of them and once without the static int8 ones (which onnxruntime's floor may exclude later).
    The per-layer factors the probes fit scale every candidate of the layer alike, so they move no candidate on or
    off the front; a candidate off both fronts is beaten on that layer whatever the target's budget."""
    options = []
    for s in scores:
        if s.error is not None or (fold_refusal and needs_fold(Recipe.parse(s.recipe))) or (
                calibration_refusal and not merges_across_calls(s.recipe)):
            continue
        noise = s.fisher if damage_kind == "kl" else s.search_noise
        cost = (latency.get(s.recipe) or {}).get("p50_ms") if objective.kind == "latency" else s.bytes
        if noise is None or cost is None:
            continue
        options.append(Option(s.recipe, noise * generalization(s), cost))
    names = {o.name for o in pareto(options)}
    return names | {o.name for o in pareto([o for o in options if not static_int8(Recipe.parse(o.name))])}


@contextlib.contextmanager
def _visiting(q: Any, device: torch.device | None):
    """While active, the kept quantized FFN `q` is on `device` (None: where it is); back in host memory after."""
    if device is None:
        yield
        return
    quantized_ffn_to(q, device)
    try:
        yield
    finally:
        quantized_ffn_to(q, candidates._CPU)


def layer_local(layer: Any, scores: Sequence[Any], kept: dict[Recipe, Any], calib: torch.Tensor, held: torch.Tensor,
                 grad: torch.Tensor, n_probe: int, source: Any, settings: Any, with_ort_floor: bool,
                 later: Sequence[Recipe] = ()) -> dict[str, Any]:
    """What one layer's own inputs give, while they are at hand: its scores, each probe's gradient-weighted error
    and noise on the probe tokens (its ablation handed to `source`), the onnxruntime floor, its range table, the
    bytes of the candidates scored `later` (deferred)."""
    probes = []
    moe = isinstance(layer, MoELayer)
    # a dense layer's probes and range table computed on the engine's device, as its scoring was
    device = current_device()
    moves = not moe and candidates._moves(device)
    on = candidates._layer_on(layer, device) if moves else layer
    x = calib[:n_probe].to(device) if moves else calib[:n_probe]  # the probe tokens lead the search tokens
    with torch.no_grad():
        ref = on.ffn(x)
    for p, q in kept.items():
        source.ablate(layer, str(p), q)
        # the same prediction restricted to the probe tokens
        with torch.no_grad(), _visiting(q, device if moves else None):
            got = q(x)
        probes.append({"recipe": str(p), "fisher_per_token": fisher_noise(grad[:n_probe], ref.cpu(), got.cpu())
                       / max(1, x.shape[0]), "noise": float((got.double() - ref.double()).square().sum())})
    # onnxruntime's floor is measured later, only on layers where the search picks a static int8 candidate
    # (`FloorSearch`); onnxruntime's quantizers take one FFN, not a layer of routed experts
    ort = "pending" if with_ort_floor and not moe else None
    t = time.perf_counter()
    if moe:
        table = moe_table(layer, calib, settings.bins)
    else:  # profile moves each chunk to the FFN's device
        chunks = ({layer.label: calib[i : i + 1024]} for i in range(0, calib.shape[0], 1024))
        table = calibrate_layers([on], chunks, settings.bins)[0][layer.label]
    return {"index": layer.index, "label": layer.label, "scores": scores, "probes": probes, "ort_best": ort,
            "n_search": calib.shape[0], "table": table, "atlas_s": time.perf_counter() - t,
            "deferred_bytes": {str(r): weight_bytes(layer, r) for r in later}}


def finish_layer(local: dict[str, Any], ablations: Mapping[tuple[int, str], Any], recipes: Sequence[Recipe],
                  latency: dict[str, dict[str, Any]], objective: Objective,
                  unscored: Mapping[str, str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One layer's rows: the per-layer fit (kappa, rho) on its probes' ablations, each candidate's predicted
    damage and cost (a deferred one's row unscored), the onnxruntime floor; (the layer's entry, its probe fit
    points)."""
    probe_rows = []
    for r in local["probes"]:
        abl = ablations[(local["index"], r["recipe"])]
        probe_rows.append({"recipe": r["recipe"], "kl": abl.kl, "nll_delta": abl.nll_delta, "hidden_nsr": abl.hidden_nsr,
                           "fisher_per_token": r["fisher_per_token"], "noise": r["noise"],
                           "hidden_signal_per_token": abl.hidden_signal / max(1, abl.tokens),
                           "hidden_noise": abl.hidden_noise})
    entry = {"label": local["label"], "kappa": _fit([(r["fisher_per_token"], r["kl"]) for r in probe_rows]),
             "rho": _fit([(r["noise"], r["hidden_noise"]) for r in probe_rows]),
             "hidden_signal_per_token": sum(r["hidden_signal_per_token"] for r in probe_rows) / max(1, len(probe_rows)),
             "search_tokens": local["n_search"], "probes": probe_rows}
    by_recipe = {s.recipe: s for s in local["scores"]}
    rows = []
    for recipe in recipes:
        s = by_recipe.get(str(recipe))
        lat = latency.get(str(recipe), {})
        if s is None and str(recipe) in unscored:  # left out before scoring (`never_chosen`)
            rows.append({**CandidateScore(str(recipe)).to_dict(), "latency_ms": lat.get("p50_ms"),
                         "excluded": unscored[str(recipe)], "scored": False})
        elif s is None:  # deferred: scored once a solution picks it on this layer (`floor.FloorSearch`)
            rows.append({**CandidateScore(str(recipe), bytes=local["deferred_bytes"][str(recipe)]).to_dict(),
                         "latency_ms": lat.get("p50_ms"), "deferred": True, "scored": False})
        else:
            rows.append(candidate_row(s, entry, latency, objective))
    fit_points = []
    for r in probe_rows:
        r["predicted_kl"] = entry["kappa"] * r["fisher_per_token"]
        fit_points.append({"layer": local["index"], **r})
    return {**entry, "candidates": rows, "ort_best": None, "ort_floor": local["ort_best"]}, fit_points


def candidate_row(s: CandidateScore, entry: Mapping[str, Any], latency: Mapping[str, Mapping[str, Any]],
                  objective: Objective) -> dict[str, Any]:
    """A scored candidate's row on its layer: its scores, predicted damage by the layer's fit (`entry`: kappa, rho,
    hidden_signal_per_token, search_tokens) and its cost."""
    row = s.to_dict()
    if s.error is None:
        # KL per token ~ kappa * fisher per token; final NSR ~ rho * noise per token / signal per token;
        # both scaled by how much worse the layer's error is on held-out inputs than on the search ones
        gen = generalization(s)
        row["generalization"] = gen
        rows_summed = s.search_rows or entry["search_tokens"]
        signal = entry["hidden_signal_per_token"]
        row["predicted_kl"] = entry["kappa"] * s.fisher / max(1, rows_summed) * gen
        row["predicted_hidden_nsr"] = ((entry["rho"] * gen * s.search_noise / max(1, rows_summed)) / signal
                                       if signal > 0 else None)
    lat = latency.get(s.recipe, {})
    row["latency_ms"] = lat.get("p50_ms")
    if objective.kind == "latency" and row["latency_ms"] is None and s.error is None:
        row["excluded"] = lat.get("reason") or "not timed"
    return row
