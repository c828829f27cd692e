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

Where the model runs: through the one engine (`planning.source.PlanSource` over `hf.stream.SequentialModel`), the model
resident or read a decoder layer at a time: the gradients by a layer-by-layer backward pass, the probes' ablations
and each verification round as streams. The modes hand the same tensors to the same steps here, so the plan and
every figure are the same.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from ..atlas import layer_atlas
from ..deploy.experts import tied_layers
from ..deploy.planned import deployable_refusal
from ..errors import FFNQuantError
from ..hf import inspect_model
from ..hf.inputs import EvalSettings, fit_settings
from ..infra.device import current_device, describe_device
from ..infra.sidecar import side_by_side
from ..measure.executor import LocalExecutor
from ..recipe import Recipe
from .floor import FloorSearch, floor_args, static_int8
from .floor import ort_floor as onnxruntime_floor  # `ort_floor` is make_plan's switch
from .candidates import HELD_ROWS, candidate_recipes, deferred, run_score_task, score_tasks
from .latency_table import measure_latency_table
from .planfile import Plan, model_fingerprint
from .runtime_latency import check_runtimes, measure_runtime_table
from .rows import (calibration_exclude, candidate_row, choosable, finish_layer, fold_exclude, layer_local,
                   never_chosen)
from .search import Option, pareto
from .sensitivity import check_plannable, noise_per_kl
from .source import PlanSource
from .steering import AIM, RoundPoint, first_noise, min_gain, next_budget
from .target import Objective, Target

if TYPE_CHECKING:  # annotations only
    from ..hf.checkpoint import ModelInfo

__all__ = ["PROBES", "final_round", "make_plan", "worst_domain"]

Progress = Callable[[str, int, int], None]
# Measured per layer to fit the prediction's scale: a mild and a strong error, both common choices.
PROBES = ("w8a8-dynamic-s8", "w4a16-g128")
# A verification round where every layer stays float: nothing to measure.
_UNCHANGED = {"hidden_sqnr_db": 200.0, "hidden_cosine": 1.0, "perplexity_delta": 0.0, "perplexity_ratio": 1.0,
              "perplexity_ratio_ci": [1.0, 1.0], "top1_agreement": 1.0, "top1_agreement_ci": [1.0, 1.0],
              "kl": {"mean": 0.0, "ci": [0.0, 0.0], "median": 0.0, "p99": 0.0, "p99_9": 0.0, "max": 0.0}}


def worst_domain(target: Target, domains: Mapping[str, Mapping[str, Any]]) -> str:
    """The held-out domain whose figure is furthest from meeting `target` (at its confidence bound)."""
    def badness(label: str) -> float:
        bound = target.bound(domains[label])
        if bound is None:
            return float("inf")
        return bound if target.metric in ("ppl", "kld") else -bound
    return max(domains, key=badness)


def final_round(result: dict[str, Any]) -> dict[str, Any]:
    """The verification round a `make_plan` result's plan comes from."""
    return result["rounds"][result["final_round"] - 1]


def _scored(executor: Any, group: Sequence[tuple], scored: Sequence[Recipe], keep: Sequence[Recipe], bins: Any,
            unscored: Sequence[Recipe] = ()):
    """Each (layer, calib, held, grad) of `group` scored as executor tasks (one per layer and remedy set); yields
    (position in the group, scores in recipe order, {recipe of `keep`: QuantizedFFN}) as each layer's tasks are in.
    `unscored` (of `scored` and `keep`): only quantized and kept (`candidates.score_layer`)."""
    tasks, owner = [], []
    for k, (layer, calib, held, grad) in enumerate(group):
        part = score_tasks(executor, layer, scored, calib, held, grad, keep=keep, bins=bins, unscored=unscored)
        tasks += part
        owner += [k] * len(part)
    waiting = {k: owner.count(k) for k in range(len(group))}
    parts: dict[int, dict[int, Any]] = {k: {} for k in range(len(group))}
    for i, result in executor.as_completed(run_score_task, tasks):
        k = owner[i]
        parts[k][i] = result
        if len(parts[k]) < waiting[k]:
            continue
        scores = [s for j in sorted(parts[k]) for s in parts[k][j][0]]
        kept = {p: q for j in sorted(parts[k]) for p, q in parts[k].pop(j)[1].items()}
        yield k, scores, {r: kept[r] for r in scored if r in kept}


def offer_budget(memory: Any) -> int | None:
    """The host memory the verification rounds' kept quantized FFNs may take (`PlanSource.offer`): half of what the
    memory plan leaves under its budget beside its estimated peak (an estimate, not a measurement); None (a quarter
    of what is free when the first is kept) without a plan or a budget."""
    if memory is None or memory.limit is None:
        return None
    return max(0, memory.limit - memory.peak) // 2


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
    memory: Any = None,
    export_format: str | None = None,
    dtype: Any = None,
    serve: str | None = None,
) -> tuple[Plan, dict[str, Any]]:
    """Plan every FFN layer of a causal LM for `target` at the least `objective`; returns (Plan, JSON-able result).

    The candidates are scored as tasks of `executor` (default: in this process); `memory` (an
    `hf.memory.MemoryPlan`, from `hf.memory.plan_memory` with `planning.source.plan_needs`; default: the model
    resident) reads the model a decoder layer at a time when its `sequential` is set, its hidden states on disk
    with `spill`. The plan depends on neither.
    `export_format` ("compressed-tensors", "onnx"): only the candidates that format can write are chosen from;
    `serve` ("vllm-cpu", `candidates.SERVE_TARGETS`): only those that server runs.
    `dtype`: what the deployed model computes in, which the verification rounds compute in (None: float32;
    bf16 for a bf16 checkpoint served by compressed-tensors' runtimes, `deploy.precision.resolve_compute_dtype`)."""
    t_start = time.perf_counter()
    executor = executor if executor is not None else LocalExecutor()
    tick = progress or (lambda *a: None)
    target = target if isinstance(target, Target) else Target.parse(target)
    objective = objective or Objective()
    info = model_dir if hasattr(model_dir, "arch") else inspect_model(model_dir, allow_pickle=allow_pickle)
    check_plannable(info, objective)
    if objective.kind == "latency" and objective.runtimes != ("ort-cpu",):
        from .runtime_latency import check_runtimes

        check_runtimes(objective.runtimes)  # an absent GPU is said before any work
    if objective.kind == "latency" and objective.runtimes == ("vllm-cpu",):
        serve = serve or "vllm-cpu"  # timed in vLLM's CPU build: only what it runs is a candidate
    if objective.kind == "latency" and objective.runtimes == ("genai-cpu",):
        export_format = export_format or "onnx"  # timed on the ONNX decoder: only what that graph writes is a candidate
    recipes, skipped = candidate_recipes(candidates, info.spec)
    if export_format is not None:  # a plan made for a format never ends in a refused export
        from .candidates import format_candidates

        recipes, skipped = format_candidates(recipes, skipped, info, export_format)
    if serve is not None:  # nor in a scheme the server it is made for does not run
        from .candidates import serve_candidates

        recipes, skipped = serve_candidates(recipes, skipped, info, serve)
    probes = [Recipe.parse(p) for p in PROBES]
    for p in probes:
        if p not in recipes:
            p.check_fits(info.spec)
    settings = fit_settings(info, settings or EvalSettings(ablation=False))
    timings: dict[str, float] = {}
    streamed = memory is not None and memory.sequential
    dtype = torch.float32 if dtype is None else dtype
    with PlanSource(info, settings, text, eval_text, probe_tokens, resident=not streamed,
                    spill=bool(memory is not None and memory.spill), progress=progress, timings=timings,
                    allow_pickle=allow_pickle, dtype=dtype, offer_budget=offer_budget(memory)) as source:
        plan, result = _search_and_verify(source, info, target, objective, recipes, skipped, probes, settings,
                                          max_rounds, ort_floor, executor, tick, progress, timings,
                                          # a compressed-tensors folder stores its routed experts under one recipe
                                          # (`deploy.experts`): their layers choose one; so do the layers calling
                                          # one FFN (its weights shared): one quantization serves them all
                                          tied=((tied_layers(info),) if export_format == "compressed-tensors" else ())
                                          + info.shared_groups())
    if dtype is not torch.float32:  # said where the verified figures are read
        name = str(dtype).removeprefix("torch.")
        plan = dataclasses.replace(plan, summary={**plan.summary, "verified_in": name})
        result["plan"] = plan.to_dict()
    result["verified_in"] = str(dtype).removeprefix("torch.")
    result["device"] = describe_device(current_device())  # where the engine computed (`--device`)
    result["timings"]["total_s"] = time.perf_counter() - t_start
    result["streamed"] = bool(streamed)
    return plan, result


def _search_and_verify(source, info, target, objective, recipes, skipped, probes, settings, max_rounds, ort_floor,
                       executor, tick, progress, timings, tied=()):
    """`make_plan` from its inputs at hand (`source`: in memory or streamed): steps 3-7 of the module docstring."""
    latency: dict[str, dict[str, Any]] = {}
    t = time.perf_counter()
    # the onnxruntime floor applies to static int8 candidates only: without any, it is not measured
    any_static = any(static_int8(r) for r in recipes)
    scored = list(dict.fromkeys(recipes + probes))
    unscored: dict[str, str] = {}
    local: dict[int, dict[str, Any]] = {}
    n_layers = info.n_layers
    # a resident model scored in this process keeps the candidates a plan could choose for the verification rounds
    retain = source.resident and isinstance(executor, LocalExecutor)
    later: list[Recipe] = []
    probe_only: list[Recipe] = []
    for group in source.groups():
        if objective.kind == "latency" and not latency:  # measured on the first layer, at the model's shape
            t_lat = time.perf_counter()
            first, calib, held, _ = group[0]
            if objective.runtimes == ("ort-cpu",):
                latency = measure_latency_table(first, recipes, calib, held, tokens=objective.tokens, progress=progress)
            elif objective.runtimes == ("vllm-cpu",):
                from .vllm_latency import measure_vllm_table

                latency = measure_vllm_table(info, recipes, objective.tokens, progress=progress)
            elif objective.runtimes == ("genai-cpu",):
                from .genai_latency import measure_genai_table

                latency = measure_genai_table(info, recipes, objective.tokens, progress=progress)
            else:
                latency = measure_runtime_table(first, recipes, check_runtimes(objective.runtimes), objective.tokens,
                                                progress=progress)
            timings["latency_table_s"] = time.perf_counter() - t_lat
            unscored = never_chosen(recipes, latency, ", ".join(objective.runtimes))
            scored = [r for r in scored if str(r) not in unscored or r in probes]  # the probes fit the prediction
        # a probe no solution can choose (never chosen, or not a candidate) is quantized for its ablation alone: the
        # fit reads its FFN on the probe tokens (`_layer_local`), never its scores
        probe_only = [p for p in probes if p not in recipes or str(p) in unscored]
        if not local:  # the deferred candidates are scored later, where a solution picks one (`FloorSearch`)
            later = [r for r in scored if deferred(r) and r not in probes]
            scored = [r for r in scored if r not in later]
            source.keep_gradients = set(source.planned) if later else set()
        # each layer is finished as soon as its tasks are in, so its quantized probes are freed early
        keep = [r for r in scored if not r.is_float] if retain else probes  # the float FFN is never offered
        for k, scores, kept in _scored(executor, group, scored, keep, settings.bins, probe_only):
            layer, calib, held, grad = group[k]
            if retain:
                front = choosable(scores, latency, objective, target.damage_kind, source.fold_refusals.get(layer.index),
                                  source.per_call_refusals.get(layer.index))
                for recipe, q in kept.items():
                    if str(recipe) in front and not recipe.is_float:
                        source.offer(layer.index, str(recipe), q)
                kept = {p: kept[p] for p in probes if p in kept}
            local[layer.index] = layer_local(layer, scores, kept, calib, held, grad, source.n_probe, source,
                                              settings, ort_floor and any_static, later)
            tick(f"candidates: {layer.label}", len(local), n_layers)
    per_layer: dict[int, dict[str, Any]] = {}
    fits: dict[int, list[dict[str, Any]]] = {}
    refusals = source.fold_refusals
    for i in sorted(local):  # in layer order, whatever order the tasks finished in
        per_layer[i], fits[i] = finish_layer(local[i], source.ablations, recipes, latency, objective, unscored)
        fold_exclude(per_layer[i]["candidates"], refusals.get(i))
        calibration_exclude(per_layer[i]["candidates"], source.per_call_refusals.get(i))
    fit_points = [p for i in sorted(fits) for p in fits[i]]
    timings["candidates_s"] = time.perf_counter() - t - timings.get("latency_table_s", 0.0)

    def damage_of(row: dict[str, Any]) -> float:
        if row.get("deferred"):  # not scored yet: a bound of its true damage, learned on the model (`FloorSearch`)
            return row.get("damage_bound", 0.0)
        if target.damage_kind == "kl":
            return row["predicted_kl"]
        return row["predicted_hidden_nsr"] if row["predicted_hidden_nsr"] is not None else float("inf")

    def cost_of(row: dict[str, Any]) -> float:
        return row["latency_ms"] if objective.kind == "latency" else float(row["bytes"])

    def options_of(i: int) -> list[Option]:
        return [Option(r["recipe"], damage_of(r), cost_of(r)) for r in per_layer[i]["candidates"]
                if r.get("error") is None and "excluded" not in r]

    if any(not options_of(i) for i in per_layer):
        raise FFNQuantError("plan: a layer has no usable candidate (fp32 failed?)")
    floor_s, measured_floors = [0.0], []

    def measure_floor(i: int) -> dict[str, Any] | None:
        return dict(measure_floors([i]))[i]  # the generator run to its end: its time is counted

    def measure_floors(indices: list[int]):
        # onnxruntime's quantizer is mostly single-threaded Python: a helper process takes layers from the other
        # end of the list on the core this one leaves idle (`infra.sidecar`); the same function of the same inputs
        t_floor = time.perf_counter()
        inputs = {}

        def args_of(i: int) -> tuple:
            inputs[i] = source.layer_inputs(i)
            return floor_args(*inputs[i], settings)

        try:
            for i, best in side_by_side(onnxruntime_floor, indices, args_of):
                measured_floors.append(i)  # at most once per layer: the count runs up to the layers planned
                tick(f"onnxruntime floor: {inputs.pop(i)[0].label}", len(measured_floors), len(per_layer))
                yield i, best
        finally:
            inputs.clear()
            floor_s[0] += time.perf_counter() - t_floor

    by_name = {str(r): r for r in recipes}  # the options carry recipe texts; the Recipes were parsed once
    deferred_s, scored_later = [0.0], []

    def score_deferred(i: int) -> None:
        t_later = time.perf_counter()
        entry = per_layer[i]
        todo = [by_name[r["recipe"]] for r in entry["candidates"] if r.get("deferred") and "excluded" not in r]
        layer, calib, held = source.layer_inputs(i)
        for _, scores, kept in _scored(executor, [(layer, calib, held, source.gradients(i))], todo,
                                       todo if retain else (), settings.bins):
            rows = {s.recipe: candidate_row(s, entry, latency, objective) for s in scores}
            entry["candidates"] = [rows.get(r["recipe"], r) if r.get("deferred") else r for r in entry["candidates"]]
            fold_exclude(entry["candidates"], refusals.get(i))
            calibration_exclude(entry["candidates"], source.per_call_refusals.get(i))
            for recipe, q in kept.items():
                source.offer(i, str(recipe), q)
        del layer, calib, held
        scored_later.append(i)
        deferred_s[0] += time.perf_counter() - t_later
        tick(f"deferred candidates ({', '.join(map(str, todo))}): L{i}", len(scored_later), len(per_layer))

    # the least saving a cost table resolves: another round, or scoring the deferred candidates, must promise more
    least_gain = min_gain(latency if objective.kind == "latency" else None)
    search = FloorSearch(per_layer, recipes, options_of, measure_floor, score_deferred, measure_many=measure_floors,
                         least_gain=least_gain, tied=tied, damage=damage_of)

    t = time.perf_counter()
    # the float model's figures in the dtype the rounds compute in (a bf16 plan's float model in bf16)
    baseline = source.verification_baselines()
    rounds: list[dict[str, Any]] = []
    points: list[RoundPoint] = []
    # the first round already allows for the interval's width on the held-out text (`first_noise`)
    w = noise_per_kl(source.ablations.values())
    prior = first_noise(target, w, {label: base.get("n_tokens") or 0 for label, base in baseline["domains"].items()})
    damage_budget = next_budget(points, target.budget, prior)
    steering = {"noise_per_kl": w, "first_noise": prior, "aim": AIM, "min_gain": least_gain}
    for rnd in range(1, max_rounds + 1):
        chosen = search.solve(damage_budget)
        if chosen is None:
            raise FFNQuantError(f"plan: no assignment meets {target} even by prediction (fp32 everywhere should): "
                                "the predicted damage of the float candidate is not zero")
        names = {i: o.name for i, o in chosen.items()}
        cost = sum(o.cost for o in chosen.values())
        if any(names == r["layers"] for r in rounds):
            break  # the budget moved but the choice did not: nothing new to verify
        passed = [r for r in rounds if r["met"]]
        if passed and cost > (1.0 - least_gain) * min(r["cost"] for r in passed):
            break  # not worth a round: it could save less than the least gain of the cheapest plan that met
        tick(f"verify round {rnd}: end to end on the held-out text", rnd, max_rounds)
        if all(name == "fp32" for name in names.values()):
            domains = {label: dict(_UNCHANGED, perplexity=base["perplexity"], n_predicted=base.get("n_tokens"))
                       for label, base in baseline["domains"].items()}
        else:
            domains = source.verify(names, by_name)
        # the target holds on every held-out domain, each at its confidence bound; the worst one steers the budget
        worst = worst_domain(target, domains)
        e2e = domains[worst]
        predicted = sum(o.damage for o in chosen.values())
        met = all(target.met(fig) for fig in domains.values())
        rounds.append({"round": rnd, "safety": damage_budget / target.budget, "budget": damage_budget,
                       "predicted": predicted, "measured": target.spent(e2e), "measured_bound": target.bound_spent(e2e),
                       "met": met, "end_to_end": e2e, "worst_domain": worst,
                       "domains": {label: dict(fig, resolution=target.resolution(fig)) for label, fig in domains.items()},
                       "cost": cost, "layers": names})
        measured = {label: (target.spent(fig), target.bound_spent(fig)) for label, fig in domains.items()}
        if all(p is not None and b is not None for p, b in measured.values()):
            points.append(RoundPoint(predicted, met, measured))
        if rnd == max_rounds:
            break
        step = next_budget(points, target.budget, prior)
        if step is None:
            break
        damage_budget = step
    # the cheapest round that met the target on the held-out text (else the last, and the result says so)
    passing = [r for r in rounds if r["met"]]
    final = min(passing, key=lambda r: r["cost"]) if passing else rounds[-1]
    options = search.options  # as the rounds left them: onnxruntime's floor applied, the deferred ones scored
    chosen = {i: next(o for o in options[i] if o.name == name) for i, name in final["layers"].items()}
    timings["verify_s"] = time.perf_counter() - t - floor_s[0] - deferred_s[0]
    timings["ort_floor_s"] = floor_s[0]
    if later:
        timings["deferred_candidates_s"] = deferred_s[0]
    source.release_gradients()
    # what a table or the search's summary reads: scored options only (a deferred one left unscored has no damage)
    for i in per_layer:
        unscored_here = {r["recipe"] for r in per_layer[i]["candidates"] if r.get("deferred")}
        options[i] = [o for o in options[i] if o.name not in unscored_here]

    # the layer atlas of the model's FFN ranges (search text), for the plan to be drawn over
    atlas = layer_atlas({f"{info.model_type}:{local[i]['label']}": local[i]["table"] for i in sorted(local)})
    timings["atlas_s"] = sum(local[i]["atlas_s"] for i in local)
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
         "measured_perplexity_ratio_ci": final["end_to_end"].get("perplexity_ratio_ci"),
         "measured_kl_mean": (final["end_to_end"].get("kl") or {}).get("mean"),
         "measured_top1_agreement": final["end_to_end"].get("top1_agreement"),
         "measured_hidden_sqnr_db": final["end_to_end"].get("hidden_sqnr_db"),
         "worst_domain": final.get("worst_domain"),
         "cost": final["cost"], "fp32_cost": fp32_cost, "objective_unit": "ms" if objective.kind == "latency" else "bytes"})
    result = {
        "model": {k: v for k, v in info.to_dict().items() if k != "layers"},
        "target": target.name, "budget": target.budget, "objective": objective.name,
        "candidates": [str(r) for r in recipes], "skipped_candidates": skipped, "probes": list(PROBES),
        "not_scored": unscored,
        # the probes quantized for their ablations alone, never scored (no solution can choose them)
        "probes_unscored": [str(p) for p in probe_only],
        "deferred": {str(r): [i for i in sorted(per_layer) for row in per_layer[i]["candidates"]
                              if row["recipe"] == str(r) and not row.get("deferred")] for r in later},
        "deferred_skipped": search.deferred_skipped,
        # what the deferred candidates' bounds on the layers they were not scored on were learned from
        "deferred_bounds": search.bounds,
        "search": "exact multiple-choice knapsack by dynamic programming over the damage budget (planning.search)",
        "calibration": source.texts["calibration"], "evaluation": source.texts["evaluation"],
        "token_budgets": source.texts["token_budgets"], "probe_tokens": source.n_probe,
        "held_rows_scored": HELD_ROWS,
        "baseline": baseline, "latency_table": latency, "layers": per_layer, "probe_fit": fit_points,
        "rounds": rounds, "steering": steering, "final_round": final["round"], "verified": bool(final["met"]), "plan": plan.to_dict(),
        "fp32_cost": fp32_cost, "single_recipes": singles,
        "pareto_per_layer": {i: [o.name for o in pareto(opts)] for i, opts in options.items()},
        "timings": timings, "atlas": atlas, "executor": executor.describe(),
        "fold_refusals": {str(i): why for i, why in sorted(refusals.items())},
        "deployment": deployment_notes(info, plan),
    }
    return plan, result


def deployment_notes(info: ModelInfo, plan: Plan | None = None) -> dict[str, str]:
    """Per export format, why this architecture, or a recipe the plan chose, cannot be written in it ('' when it
    can): the plan says so before the export is run."""
    out = {fmt: deployable_refusal(info, fmt) or "" for fmt in ("compressed-tensors", "onnx")}
    if plan is not None and not out["compressed-tensors"]:
        try:
            from ..deploy.ctensors import plan_refusal
        except Exception:  # the deploy extra is not installed: nothing to say about its format
            return out
        out["compressed-tensors"] = plan_refusal(plan, info) or ""
    if plan is not None and not out["onnx"]:  # routed experts: one QMoE node per layer, which stores fewer recipes
        from ..deploy.experts import tied_layers
        from ..deploy.onnx_experts import experts_recipe_refusal

        for i in tied_layers(info):
            why = experts_recipe_refusal(plan.layers[i], info) if i in plan.layers else None
            if why:
                out["onnx"] = (f"layer L{i}: {why}; its whole-model graph is not written (per-layer ONNX artifacts "
                               "are)")
                break
    return out
