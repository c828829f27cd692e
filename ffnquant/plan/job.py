"""`make_plan`: candidates scored per layer, the cheapest assignment under the target, verified end to end.

1. Capture each FFN's inputs on the calibration text (the search data) and the held-out text (`hf.inputs`).
2. One backward pass of the float model on the search text: the loss gradient at every FFN output.
3. Score every candidate recipe on every layer (`candidates.score_layer`), as tasks of an executor (this process,
   or Ray workers: `candidates.score_tasks`); each layer is finished here as its tasks come back.
4. Predict each candidate's end-to-end damage: its gradient-weighted output error (`fisher`) times a per-layer
   factor fitted on measured ablations of two probe recipes on that layer (KL of the next-token distribution
   for a ppl target; final hidden noise for an SQNR target), times how much worse the candidate's layer error
   is on held-out inputs than on the search inputs it was calibrated on (`candidates.generalization`: GPTQ
   fits its calibration tokens). Probes are measured, the rest predicted.
5. Cost per candidate: FFN latency from a measured table at the model's shape (`latency_table`), or bytes.
   A static int8 candidate below onnxruntime's best own quantizer on that layer (`ort_floor`) is left out.
6. Search (`search.solve`, exact multiple-choice knapsack) within the target's budget times a safety factor.
7. Verify: quantize every layer as planned, put them all back, measure ppl and final hidden SQNR on the
   search text and on the held-out text. If the held-out text misses the target, shrink the safety factor by
   the overshoot (or halfway back to the last budget that met) and repeat; if it meets it and the search text
   shows the plan spending well under the budget (the additive prediction is first order), allow more.
   The plan is the cheapest round that met the target on the held-out text.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

import torch

from ..errors import FFNQuantError
from ..recipe import Recipe
from .candidates import candidate_recipes, generalization, quantize_layer, run_score_task, score_tasks
from .planfile import Plan, model_fingerprint
from .search import Option, pareto, solve
from .sensitivity import SuffixRunner, check_plannable, fisher_noise, output_gradients
from .target import Objective, Target

__all__ = ["PROBES", "final_round", "make_plan", "next_safety", "plan_memory_needed", "check_plan_memory"]

Progress = Callable[[str, int, int], None]
# Measured per layer to fit the prediction's scale: a mild and a strong error, both common choices.
PROBES = ("w8a8-dynamic-s8", "w4a16-g128")


def final_round(result: dict[str, Any]) -> dict[str, Any]:
    """The verification round a `make_plan` result's plan comes from."""
    return result["rounds"][result["final_round"] - 1]


def next_safety(safety: float, met: bool, spent: float | None, spent_search: float | None, budget: float,
                met_safety: float | None, missed_safety: float | None) -> float | None:
    """The next verification round's budget factor, or None when the plan is settled.

    A round that met the target: when the search text (never the held-out one) shows the whole plan spending
    well under the budget (room >= 1.4: the additive prediction is first order), spend more next round, by the
    room seen (at most 3x), or halfway (geometrically) back toward a factor that already missed. A round that
    missed: halfway back toward the last factor that met, or, with none yet, less in proportion to the
    overshoot (at least 30% less)."""
    if met:
        room = budget / max(spent_search or 0.0, budget / 20)
        if room < 1.4:
            return None
        return safety * min(3.0, 0.8 * room) if missed_safety is None else math.sqrt(safety * missed_safety)
    if met_safety is not None:
        return math.sqrt(safety * met_safety)
    return safety * (min(0.7, budget / spent) if spent and spent > 0 else 0.5)


def plan_memory_needed(info: Any, *, calib_tokens: int, eval_tokens: int, probe_tokens: int,
                       batch_tokens: int) -> dict[str, int]:
    """Bytes `make_plan` holds at its peak, by part, and their `total`: it keeps the whole model in float32 (its
    gradients and ablations run the whole model; plans do not stream layer by layer). Measured against
    a 110M-parameter Llama (d_model 1024, d_ff 2816, 4 layers, vocabulary 32,000) at 512+512 tokens: estimate
    2.0 GB, peak RSS 1.93 GB."""
    from ..hf.stream import _RUNTIME_BYTES
    from ..resources import process_rss

    spec, n = info.spec, info.n_layers
    d, vocab = spec.d_model, int(info.config.get("vocab_size") or 0)
    parts = {
        "runtime": process_rss() + _RUNTIME_BYTES,
        "model": info.n_params_total * 4,
        # each FFN loaded on its own for scoring, and the verification rounds' quantized copies
        "ffn_copies": 2 * n * spec.n_params * 4,
        # every layer's FFN inputs (search + held-out), the loss gradient at its output, the probes' block outputs
        "hidden_states": n * (2 * calib_tokens + eval_tokens + probe_tokens) * d * 4,
        # the probes' next-token log-probabilities, one batch's logits in float32 and float64 and their gradient
        "vocabulary": (probe_tokens + 4 * batch_tokens) * vocab * 4,
        # one batch's activations kept for the backward pass through every block
        "backward": batch_tokens * n * (8 * d + 4 * spec.d_ff) * 4,
    }
    parts["total"] = sum(parts.values())
    return parts


def check_plan_memory(info: Any, max_memory: int | None, **tokens: int) -> dict[str, int]:
    """`plan_memory_needed`, refused up front in one line with the numbers when it exceeds `max_memory` (default:
    what this process holds plus what the machine has available)."""
    from ..resources import human_bytes, memory_limit

    need = plan_memory_needed(info, **tokens)
    limit = memory_limit(max_memory)
    if limit is not None and need["total"] > limit:
        big = ", ".join(f"{k.replace('_', ' ')} {human_bytes(v)}" for k, v in need.items() if k != "total")
        raise FFNQuantError(
            f"{info.path}: plan holds the whole model in float32 (its loss gradients and ablations run the whole "
            f"model) and needs about {human_bytes(need['total'])} ({big}), over the {human_bytes(limit)} memory "
            f"budget: pass fewer --calib-tokens/--eval-tokens/--probe-tokens, a larger --max-memory, or plan on a "
            f"machine with more memory (profile and quantize --model stream layer by layer)")
    return need


def _fit(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope through the origin of measured against predicted (>= 0)."""
    num = sum(m * p for p, m in points)
    den = sum(p * p for p, m in points)
    return max(0.0, num / den) if den > 0 else 0.0


def _ort_floor(layer: Any, calib: torch.Tensor, held: torch.Tensor, recipes: Sequence[Recipe], rows: list[dict[str, Any]],
               settings: Any):
    """onnxruntime's best own quantizer of this layer (quantize_static MinMax / Percentile / Entropy and
    quantize_dynamic, on the same calibration and held-out inputs); every static int8 candidate whose held-out
    layer SQNR falls below it is excluded: a user would do better with onnxruntime's quantizer alone."""
    import tempfile
    from pathlib import Path

    from ..accuracy import run_batched
    from ..export import export_onnx
    from ..ortbaseline import ort_baselines

    with tempfile.TemporaryDirectory(prefix="ffnquant-plan-ort-") as folder:
        fp32 = Path(folder) / f"{layer.label}.fp32.onnx"
        export_onnx(layer.ffn, fp32)
        with torch.no_grad():
            ref = run_batched(layer.ffn, held)
        res = ort_baselines(fp32, [calib[i : i + 1024] for i in range(0, calib.shape[0], 1024)], held, ref,
                            run_tokens=settings.seq_len * settings.batch_size)
    best = res.get("best")
    if not best:
        return None
    for recipe, row in zip(recipes, rows):
        if row.get("error") is not None or "excluded" in row:
            continue
        scheme = recipe.resolve()
        if scheme.static_activations and scheme.act_dtype.is_integer and row["layer_sqnr_db"] < best["sqnr_db"]:
            row["excluded"] = (f"below onnxruntime's best own quantizer on this layer ({row['layer_sqnr_db']:.1f} dB < "
                               f"{best['sqnr_db']:.1f} dB, {best['method']})")
    return {"method": best["method"], "sqnr_db": best["sqnr_db"],
            "methods": {m: v.get("sqnr_db") for m, v in res["methods"].items()}}


def _finish_layer(layer: Any, scores: Sequence[Any], kept: dict[Recipe, Any], recipes: Sequence[Recipe], inputs: Any,
                  grads: dict[str, torch.Tensor], runner: Any, n_probe: int, latency: dict[str, dict[str, Any]],
                  objective: Objective, settings: Any, with_ort_floor: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One layer's rows from its scores: the probes ablated on the whole model, the per-layer fit (kappa, rho),
    each candidate's predicted damage and cost, the onnxruntime floor; (the layer's entry, its probe fit points)."""
    calib, held = inputs.calib[layer.label], inputs.eval[layer.label]
    by_recipe = {s.recipe: s for s in scores}
    probe_rows = []
    for p, q in kept.items():
        abl = runner.ablate(layer.index, q)
        # the same prediction restricted to the probe tokens, which lead the search tokens
        with torch.no_grad():
            x = calib[:n_probe]
            ref, got = layer.ffn(x), q(x)
        fisher = fisher_noise(grads[layer.label][:n_probe], ref, got) / max(1, x.shape[0])
        energy = float((got.double() - ref.double()).square().sum())
        probe_rows.append({"recipe": str(p), "kl": abl.kl, "nll_delta": abl.nll_delta, "hidden_nsr": abl.hidden_nsr,
                           "fisher_per_token": fisher, "noise": energy,
                           "hidden_signal_per_token": abl.hidden_signal / max(1, abl.tokens),
                           "hidden_noise": abl.hidden_noise})
    kappa = _fit([(r["fisher_per_token"], r["kl"]) for r in probe_rows])
    rho = _fit([(r["noise"], r["hidden_noise"]) for r in probe_rows])
    signal = sum(r["hidden_signal_per_token"] for r in probe_rows) / max(1, len(probe_rows))
    n_search = calib.shape[0]
    rows = []
    for recipe in recipes:
        s = by_recipe[str(recipe)]
        row = s.to_dict()
        if s.error is None:
            # KL per token ~ kappa * fisher per token; final NSR ~ rho * noise per token / signal per token;
            # both scaled by how much worse the layer's error is on held-out inputs than on the search ones
            gen = generalization(s)
            row["generalization"] = gen
            row["predicted_kl"] = kappa * s.fisher / max(1, n_search) * gen
            row["predicted_hidden_nsr"] = (rho * gen * s.search_noise / max(1, n_search)) / signal if signal > 0 else None
        lat = latency.get(str(recipe), {})
        row["latency_ms"] = lat.get("p50_ms")
        if objective.kind == "latency" and row["latency_ms"] is None and s.error is None:
            row["excluded"] = lat.get("reason") or "not timed"
        rows.append(row)
    fit_points = []
    for r in probe_rows:
        r["predicted_kl"] = kappa * r["fisher_per_token"]
        fit_points.append({"layer": layer.index, **r})
    ort = _ort_floor(layer, calib, held, recipes, rows, settings) if with_ort_floor else None
    return {"label": layer.label, "kappa": kappa, "rho": rho, "probes": probe_rows, "candidates": rows,
            "ort_best": ort}, fit_points


def make_plan(
    model_dir: Any,
    target: Target | str,
    objective: Objective | None = None,
    candidates: str | Sequence[str] = "default",
    text: Any = None,
    eval_text: Any = None,
    settings: Any = None,
    probe_tokens: int = 512,
    max_rounds: int = 4,
    ort_floor: bool = True,
    allow_pickle: bool = False,
    progress: Progress | None = None,
    executor: Any = None,
) -> tuple[Plan, dict[str, Any]]:
    """Plan every FFN layer of a causal LM for `target` at the least `objective`; returns (Plan, JSON-able result).

    The candidates are scored as tasks of `executor` (default: in this process); the plan does not depend on it."""
    from ..executor import LocalExecutor
    from ..hf import inspect_model, load_ffn_layers
    from ..hf.evaluate import end_to_end, float_baseline
    from ..hf.inputs import EvalSettings, capture_layer_inputs, fit_settings
    from .latency_table import measure_latency_table

    t_start = time.perf_counter()
    executor = executor if executor is not None else LocalExecutor()
    tick = progress or (lambda *a: None)
    target = target if isinstance(target, Target) else Target.parse(target)
    objective = objective or Objective()
    info = model_dir if hasattr(model_dir, "arch") else inspect_model(model_dir, allow_pickle=allow_pickle)
    check_plannable(info)
    recipes, skipped = candidate_recipes(candidates, info.spec)
    probes = [Recipe.parse(p) for p in PROBES]
    for p in probes:
        if p not in recipes:
            p.check_fits(info.spec)
    layers = load_ffn_layers(info, "all", allow_pickle=allow_pickle)
    settings = fit_settings(info, settings or EvalSettings(ablation=False))
    timings: dict[str, float] = {}

    t = time.perf_counter()
    inputs = capture_layer_inputs(info, layers, text=text, eval_text=eval_text, calib_tokens=settings.max_calib_tokens,
                                  eval_tokens=settings.max_eval_tokens, settings=settings, allow_pickle=allow_pickle,
                                  progress=progress)
    model = inputs.model
    for p in model.parameters():
        p.requires_grad_(False)
    timings["capture_s"] = time.perf_counter() - t

    t = time.perf_counter()
    tick("loss gradients at every FFN output (search text)", 0, 1)
    grads = output_gradients(model, info, [l.info for l in layers], inputs.calib_batches)
    timings["gradients_s"] = time.perf_counter() - t

    probe_batches, n_probe = [], 0
    for ids in inputs.calib_batches:  # the probes run on the first `probe_tokens` of the search text
        if n_probe >= probe_tokens:
            break
        probe_batches.append(ids)
        n_probe += int(ids.numel())
    runner = SuffixRunner(model, info, [l.info for l in layers], probe_batches).record()

    latency: dict[str, dict[str, Any]] = {}
    if objective.kind == "latency":
        t = time.perf_counter()
        first = layers[0]
        latency = measure_latency_table(first, recipes, inputs.calib[first.label], inputs.eval[first.label],
                                        tokens=objective.tokens, progress=progress)
        timings["latency_table_s"] = time.perf_counter() - t

    t = time.perf_counter()
    # the onnxruntime floor applies to static int8 candidates only: without any, it is not measured
    any_static = any(r.resolve().static_activations and r.resolve().act_dtype.is_integer for r in recipes)
    per_layer: dict[int, dict[str, Any]] = {}
    fits: dict[int, list[dict[str, Any]]] = {}
    scored = list(dict.fromkeys(recipes + probes))
    # the scoring as tasks (one per layer and remedy set); each layer is finished here (probe ablations need
    # the whole model) as soon as its tasks are in, so its quantized probes are freed early
    tasks, owner = [], []
    for k, layer in enumerate(layers):
        group = score_tasks(executor, layer, scored, inputs.calib[layer.label], inputs.eval[layer.label],
                            grads[layer.label], keep=probes, bins=settings.bins)
        tasks += group
        owner += [k] * len(group)
    waiting = {k: owner.count(k) for k in range(len(layers))}
    parts: dict[int, dict[int, Any]] = {k: {} for k in range(len(layers))}
    for i, result in executor.as_completed(run_score_task, tasks):
        k = owner[i]
        parts[k][i] = result
        if len(parts[k]) < waiting[k]:
            continue
        scores = [s for j in sorted(parts[k]) for s in parts[k][j][0]]
        kept = {p: q for j in sorted(parts[k]) for p, q in parts[k].pop(j)[1].items()}
        layer = layers[k]
        per_layer[layer.index], fits[layer.index] = _finish_layer(
            layer, scores, {r: kept[r] for r in scored if r in kept}, recipes, inputs, grads, runner, n_probe, latency,
            objective, settings, ort_floor and any_static)
        tick(f"candidates: {layer.label}", len(per_layer), len(layers))
    # in layer order, whatever order the tasks finished in
    per_layer = {layer.index: per_layer[layer.index] for layer in layers}
    fit_points = [p for layer in layers for p in fits[layer.index]]
    timings["candidates_s"] = time.perf_counter() - t

    def damage(row: dict[str, Any]) -> float:
        if target.metric == "ppl":
            return row["predicted_kl"]
        return row["predicted_hidden_nsr"] if row["predicted_hidden_nsr"] is not None else float("inf")

    def cost(row: dict[str, Any]) -> float:
        return row["latency_ms"] if objective.kind == "latency" else float(row["bytes"])

    options = {i: [Option(r["recipe"], damage(r), cost(r)) for r in d["candidates"]
                   if r.get("error") is None and "excluded" not in r]
               for i, d in per_layer.items()}
    if any(not opts for opts in options.values()):
        raise FFNQuantError("plan: a layer has no usable candidate (fp32 failed?)")

    t = time.perf_counter()
    baseline = float_baseline(model, info, inputs.eval_batches)
    search_baseline = float_baseline(model, info, inputs.calib_batches)
    by_index = {layer.index: layer for layer in layers}
    by_name = {str(r): r for r in recipes}  # the options carry recipe texts; the Recipes were parsed once
    cache: dict[tuple[int, str], Any] = {}
    rounds: list[dict[str, Any]] = []
    safety, met_safety, missed_safety = 1.0, None, None
    same = {"hidden_sqnr_db": 200.0, "hidden_cosine": 1.0, "perplexity_delta": 0.0, "perplexity_ratio": 1.0}
    for rnd in range(1, max_rounds + 1):
        chosen = solve(options, target.budget * safety)
        if chosen is None:
            raise FFNQuantError(f"plan: no assignment meets {target} even by prediction (fp32 everywhere should): "
                                "the predicted damage of the float candidate is not zero")
        if rounds and {i: o.name for i, o in chosen.items()} == rounds[-1]["layers"]:
            break  # the budget moved but the choice did not: nothing new to verify
        qffns = {}
        for i, opt in chosen.items():
            if opt.name == "fp32":
                continue
            key = (i, opt.name)
            if key not in cache:
                layer = by_index[i]
                cache[key] = quantize_layer(layer, by_name[opt.name], inputs.calib[layer.label],
                                            inputs.eval[layer.label], bins=settings.bins)[0]
            qffns[by_index[i].label] = cache[key]
        tick(f"verify round {rnd}: end to end on the search and held-out texts", rnd, max_rounds)
        # the whole plan on the search text: how the additive prediction compares with the real sum there
        on_search = end_to_end(model, info, layers, qffns, inputs.calib_batches, settings, search_baseline)["end_to_end"] \
            if qffns else dict(same, perplexity=search_baseline["perplexity"])
        e2e = end_to_end(model, info, layers, qffns, inputs.eval_batches, settings, baseline)["end_to_end"] \
            if qffns else dict(same, perplexity=baseline["perplexity"])
        predicted = sum(o.damage for o in chosen.values())
        spent, spent_search = target.spent(e2e), target.spent(on_search)
        met = target.met(e2e)
        rounds.append({"round": rnd, "safety": safety, "budget": target.budget * safety, "predicted": predicted,
                       "measured_search": spent_search, "search_end_to_end": on_search,
                       "measured": spent, "met": met, "end_to_end": e2e,
                       "cost": sum(o.cost for o in chosen.values()),
                       "layers": {i: o.name for i, o in chosen.items()}})
        if met:
            met_safety = safety
        else:
            missed_safety = safety
        if rnd == max_rounds:
            break
        step = next_safety(safety, met, spent, spent_search, target.budget, met_safety, missed_safety)
        if step is None:
            break
        safety = step
    # the cheapest round that met the target on the held-out text (else the last, and the result says so)
    passing = [r for r in rounds if r["met"]]
    final = min(passing, key=lambda r: r["cost"]) if passing else rounds[-1]
    chosen = {i: next(o for o in options[i] if o.name == name) for i, name in final["layers"].items()}
    timings["verify_s"] = time.perf_counter() - t

    # the layer atlas of the model's FFN ranges (search text), for the plan to be drawn over
    t = time.perf_counter()
    from ..atlas import layer_atlas
    from ..hf.evaluate import calibrate_layers

    chunks = ({layer.label: x[i : i + 1024]} for layer in layers for x in [inputs.calib[layer.label]]
              for i in range(0, x.shape[0], 1024))
    tables, _ = calibrate_layers(layers, chunks, settings.bins)
    atlas = layer_atlas({f"{info.model_type}:{label}": table for label, table in tables.items()})
    timings["atlas_s"] = time.perf_counter() - t
    fp32_cost = sum(next(o.cost for o in options[i] if o.name == "fp32") for i in options)
    singles = []
    for recipe in recipes:
        name = str(recipe)
        if all(any(o.name == name for o in options[i]) for i in options):
            singles.append({"recipe": name, "cost": sum(next(o.cost for o in options[i] if o.name == name) for i in options),
                            "predicted": sum(next(o.damage for o in options[i] if o.name == name) for i in options)})
    plan = Plan(
        model_fingerprint(info) | {"path": str(info.path)}, {i: by_name[o.name] for i, o in chosen.items()},
        target.name, objective.name,
        {"verified": bool(final["met"]), "rounds": len(rounds),
         "measured_perplexity_ratio": final["end_to_end"].get("perplexity_ratio"),
         "measured_hidden_sqnr_db": final["end_to_end"].get("hidden_sqnr_db"),
         "cost": final["cost"], "fp32_cost": fp32_cost, "objective_unit": "ms" if objective.kind == "latency" else "bytes"})
    timings["total_s"] = time.perf_counter() - t_start
    result = {
        "model": {k: v for k, v in info.to_dict().items() if k != "layers"},
        "target": target.name, "budget": target.budget, "objective": objective.name,
        "candidates": [str(r) for r in recipes], "skipped_candidates": skipped, "probes": list(PROBES),
        "search": "exact multiple-choice knapsack by dynamic programming over the damage budget (plan.search)",
        "calibration": inputs.calibration_source, "evaluation": inputs.evaluation_source,
        "token_budgets": inputs.budgets, "probe_tokens": n_probe,
        "baseline": baseline, "latency_table": latency, "layers": per_layer, "probe_fit": fit_points,
        "rounds": rounds, "final_round": final["round"], "verified": bool(final["met"]), "plan": plan.to_dict(),
        "fp32_cost": fp32_cost, "single_recipes": singles,
        "pareto_per_layer": {i: [o.name for o in pareto(opts)] for i, opts in options.items()},
        "timings": timings, "atlas": atlas, "executor": executor.describe(),
    }
    return plan, result
