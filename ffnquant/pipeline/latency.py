"""Stage: latency of every (FFN, recipe, runtime, tokens) the runtimes support, through `ffnquant.bench`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from .. import bench
from ..errors import FFNQuantError
from ..measure.latency import MIN_TIMED_SAMPLES
from ..recipe import Recipe
from ..runtimes import get_runtime, runtime_names
from ..runtimes.base import FORMATS
from ..spec import FFNSpec
from .results import Progress

__all__ = ["LatencySettings", "select_runtimes", "measure_latency"]


@dataclass(frozen=True)
class LatencySettings:
    """What the latency stage reads of a run's config: the runtimes asked for (names, or 'available' or
    'none' alone), the token counts, the time budget per case and the seed of the timed inputs."""

    runtimes: tuple[str, ...]
    tokens: tuple[int, ...]
    budget_s: float
    seed: int

    def __post_init__(self) -> None:
        if not self.runtimes or not self.tokens:
            raise FFNQuantError(f"latency settings need runtimes and token counts, got {self.runtimes!r}, {self.tokens!r}")

    @property
    def none(self) -> bool:
        """No runtime requested: accuracy only."""
        return self.runtimes == ("none",)


def select_runtimes(requested: Sequence[str]) -> list[tuple[str, Any, Any]]:
    """[(name, Availability, Runtime)] to measure on, from a config's runtime names ('available' or 'none'
    alone, or names). Explicitly named unavailable runtimes are an error."""
    requested = tuple(requested)
    if requested == ("none",):
        return []
    names = runtime_names() if requested == ("available",) else requested
    out = []
    for name in names:
        rt = get_runtime(name)  # unknown names raise, listing the valid ones
        avail = rt.availability()
        if not avail.available and requested != ("available",):
            raise FFNQuantError(f"runtime {name!r} is not available here: {avail.reason}")
        out.append((name, avail, rt))
    return out


def measure_latency(
    settings: LatencySettings, specs: Sequence[FFNSpec], recipes: Sequence[Recipe], models: Mapping[str, Any],
    onnx_paths: Mapping[tuple[str, str], Path], runtimes: Sequence[tuple[str, Any, Any]], missing: list[dict],
    progress: Progress | None,
) -> dict[str, Any]:
    """The report's latency section: every case the runtimes can time honestly under the recipe's name.

    A recipe without remedies is timed on every runtime that registers its scheme (a calibrator changes
    the constants of a static graph, not its kernels). A recipe with remedies (smoothing, rotation) is
    timed only on the artifact written for it: a runtime that quantizes the float FFN itself, or an
    artifact built without the remedy (no Hadamard MatMul), would time another model under its name.
    """
    section: dict[str, Any] = {
        "status": "ok", "reason": None, "primary_tokens": max(settings.tokens),
        "runtimes": [{"name": n, "available": bool(a.available), "reason": a.reason, "device": a.device, "error": None}
                     for n, a, _ in runtimes],
        "cases": [], "skipped": [],
    }
    if settings.none:
        section.update(status="missing", reason="no runtimes requested (runtimes = none): accuracy only")
        missing.append({"part": "latency and recommendations", "reason": section["reason"]})
        return section
    unknown = sorted({r.scheme for r in recipes if r.scheme not in FORMATS})
    if unknown:
        missing.append({"part": f"latency of {', '.join(unknown)}", "reason": "no runtime format of that name"})
    first: dict[str, Recipe] = {}  # scheme -> its first recipe without remedies: timed on every runtime
    extra: list[Recipe] = []  # timed on their own artifacts only
    for r in recipes:
        if r.scheme not in FORMATS:
            continue
        if r.has_remedies or r.scheme in first:
            extra.append(r)
        else:
            first[r.scheme] = r
    # One warm-up, then timed calls until the budget is spent AND the sample count a recommendation needs
    # (MIN_TIMED_SAMPLES) is reached: the budget is a target, not a cap. A floor below that count would make a
    # case slower than budget/5 (every 512-token case at the default budget) suspect and unrecommendable.
    # The accuracy stage scores every recipe against its reference already: no second reference here.
    bconf = bench.BenchConfig(tokens=settings.tokens, budget_s=settings.budget_s, warmup=1,
                              min_repeats=MIN_TIMED_SAMPLES, seed=settings.seed, reference_check=False)
    sweeper = _Sweeper(bench, bconf, specs, models, onnx_paths, progress)
    runtime_objs = [rt for _, _, rt in runtimes]
    cases: list[dict] = []
    rows: dict[str, dict] = {}
    if first:
        main = sweeper.sweep(specs, first, runtime_objs)
        cases += [dict(c.to_dict(), scheme=first[c.scheme].name if c.scheme in first else c.scheme) for c in main.cases]
        rows = {r["name"]: dict(r) for r in main.runtimes}
        section["skipped"] += list(main.skipped)
    onnx_rts = [rt for rt in runtime_objs if rt.loads_artifacts]
    for recipe in extra:
        own = [s for s in specs if (s.variant.value, recipe.name) in onnx_paths]
        specs_timed = own if recipe.has_remedies else list(specs)
        if recipe.has_remedies and len(own) < len(specs):
            without = [s.variant.value for s in specs if s not in own]
            section["skipped"].append({"scheme": recipe.name, "variant": ", ".join(without),
                                       "reason": "no ONNX artifact of this recipe (onnx = false, or the recipe did not "
                                                 "apply): a plain artifact would time another model under its name"})
        if not onnx_rts or not specs_timed:
            continue
        res = sweeper.sweep(specs_timed, {recipe.scheme: recipe}, onnx_rts)
        cases += [dict(c.to_dict(), scheme=recipe.name) for c in res.cases if c.scheme == recipe.scheme]
        for r in res.runtimes:  # the baseline the harness re-measured for this sweep's speedups is left out above
            row = rows.setdefault(r["name"], dict(r))
            if r.get("error") and not row.get("error"):
                row["error"] = r["error"]
    for c in cases:
        for k, v in list(c.items()):
            if isinstance(v, float) and not math.isfinite(v):
                c[k] = None
    section["runtimes"] = [
        {"name": r["name"], "available": bool(r["available"]), "reason": str(r["reason"]), "device": r.get("device"),
         "error": r.get("error"), "ran_with": list(r.get("ran_with", []))}
        for r in rows.values()
    ] or section["runtimes"]
    section["cases"] = cases
    failed = [r["name"] for r in section["runtimes"] if r["error"]]
    if not any(c["error"] is None for c in cases):
        section.update(status="missing", reason="no latency case could be measured")
        missing.append({"part": "latency", "reason": section["reason"]})
    elif failed:
        section.update(status="partial", reason=f"runtime(s) failed during the run: {', '.join(failed)}")
    return section


class _Sweeper:
    """Runs `bench.run_benchmark` sweeps with the run's artifacts and one continuous progress count."""

    def __init__(self, bench: Any, bconf: Any, specs: Sequence[FFNSpec], models: Mapping[str, Any],
                 onnx_paths: Mapping[tuple[str, str], Path], progress: Progress | None) -> None:
        key_of = {s.variant.value: s.key for s in specs}
        self.bench, self.bconf, self.onnx_paths, self.progress = bench, bconf, onnx_paths, progress
        self.models = {key_of[v]: m for v, m in models.items() if v in key_of}
        self.done = 0

    def sweep(self, specs: Sequence[FFNSpec], recipe_of_format: Mapping[str, Recipe], runtimes: Sequence[Any]) -> Any:
        paths = {}
        for spec in specs:
            v = spec.variant.value
            for fmt, recipe in recipe_of_format.items():
                p = self.onnx_paths.get((v, recipe.name))
                if p is not None:
                    paths[(spec.key, fmt)] = p
        offset = self.done

        def cb(done: int, total: int, label: str) -> None:
            if self.progress is not None:
                self.progress(f"latency {label}", offset + done, offset + total)

        res = self.bench.run_benchmark(specs, runtimes, list(recipe_of_format), self.bconf,
                                       models={s.key: self.models[s.key] for s in specs if s.key in self.models},
                                       onnx_paths=paths, progress=cb)
        self.done = offset + len(res.cases)
        return res
