"""`run(config)`: the main job's orchestration, stage by stage. It measures and writes, never prints."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..data import calibration_and_eval
from ..infra.atomic import OutputTransaction, write_text
from ..infra.render import display_path
from ..measure.recommend import join_points
from ..model import build
from ..numerics.observe import profile
from ..report import write_report
from . import findings as F
from .config import RunConfig
from .model import ModelSettings, check_model, model_layers
from .results import ModelPart, Progress, RunResult, Stages
from .variants import Scoring, score_recipes

__all__ = ["run"]


def run(config: RunConfig, progress: Progress | None = None, command: str | None = None) -> RunResult:
    """Profile, quantize, export, benchmark and report every variant of `config` (and its model's layers).

    Everything is validated before anything is written (bad sizes, data, model folders or an explicitly
    requested runtime that is unavailable raise FFNQuantError). A runtime that fails midway is recorded
    in the report and the rest of the run completes. The output folders change only when the whole run
    succeeds (`atomic.OutputTransaction`).
    """
    import torch

    from .latency import LatencySettings, measure_latency, select_runtimes

    t_start = time.perf_counter()
    stages = Stages()
    missing: list[dict[str, str]] = []
    command = command or "ffnquant.run(RunConfig(...))"

    # --- the one place that reads the config: each stage gets the fields it uses -----------
    specs = config.specs()
    recipes = config.recipes
    scoring = Scoring(seed=config.seed, baseline=config.baseline, sensitivity=config.sensitivity)
    timing = LatencySettings(runtimes=config.runtimes, tokens=config.tokens, budget_s=config.budget_s, seed=config.seed)
    model_settings = None if config.model is None else ModelSettings(
        model=config.model, layers=config.layers, text=config.text, eval_text=config.eval_text, plan=config.plan,
        calib_tokens=config.calib_tokens, eval_tokens=config.eval_tokens, bins=config.bins,
        batch_size=config.batch_size)

    # --- validate everything first --------------------------------------------------------
    for spec in specs:
        for recipe in recipes:
            recipe.check_fits(spec)
    runtimes = select_runtimes(config.runtimes)
    source = config.token_source()
    calib_source, eval_tokens = calibration_and_eval(source, config.calib_tokens, config.eval_tokens, config.d_model)
    calib_source.available(config.d_model)  # reads and validates a token file now, before writing anything
    model_info = check_model(model_settings) if model_settings is not None else None
    # The whole output set is staged beside its folders and moved into place only once every file is
    # written: a failure, a full disk or Ctrl-C leaves the reports and artifacts folders as they were,
    # and an earlier file is replaced only by this run's file of the same name.
    with OutputTransaction() as tx:
        out_reports = tx.folder(config.out_reports)
        out_export = tx.folder(config.out_export) if config.onnx else None
        n_units = len(specs) * (1 + len(recipes))
        if model_info is not None:
            info, indices = model_info
            n_units += len(indices) * (1 if info.n_experts is None else info.n_experts) * len(recipes) + 2
        done = 0

        def tick(message: str, units: int = 1) -> None:
            nonlocal done
            done += units
            if progress is not None:
                progress(message, done, n_units)

        torch.manual_seed(config.seed)  # nothing below should draw from the global generator; belt and braces
        tables: dict[str, Any] = {}
        rows: list[dict] = []
        artifacts: list[dict] = []
        models: dict[str, Any] = {}
        onnx_paths: dict[tuple[str, str], Path] = {}
        timed_claims: list[dict] = []
        ort_baselines: list[dict] = []
        calib_tokens = calib_source.tokens(config.calib_tokens, config.d_model)

        # --- the synthetic variants: profile, then every recipe -------------------------------
        for spec in specs:
            v = spec.variant.value
            t0 = time.perf_counter()
            model = models[v] = build(spec, seed=config.seed)
            tables[v] = profile(model, calib_source.batches(config.calib_tokens, spec.d_model, config.batch_size),
                                bins=config.bins)
            stages.add("profile", time.perf_counter() - t0)
            tick(f"{v}: profiled")
            t0 = time.perf_counter()
            res = score_recipes(spec, model, recipes, scoring, calib_tokens, eval_tokens, out_export, tick)
            rows += res.rows
            artifacts += res.artifacts
            ort_baselines += [res.ort_baseline] if res.ort_baseline is not None else []
            onnx_paths.update({(v, name): p for name, p in res.paths.items()})
            stages.add("quantize and export", time.perf_counter() - t0)
            if v in ("relu", "swiglu"):
                timed_claims.append(F.activation_time_claim(model, eval_tokens[: max(config.tokens)]))

        # --- the real model's layers ------------------------------------------------------------
        model_part: ModelPart | None = None
        if model_info is not None and model_settings is not None:
            model_part = model_layers(model_settings, scoring, timing, model_info[0], recipes, out_export, runtimes, tick,
                                      progress, stages)
            tables.update(model_part.tables)
            rows += model_part.rows
            artifacts += model_part.artifacts
            ort_baselines += model_part.baselines

        ranges, claims = F.range_section(tables, {"seed": config.seed, "source_label": source.label})

        # --- latency ------------------------------------------------------------------------------
        t0 = time.perf_counter()
        latency = measure_latency(timing, specs, recipes, models, onnx_paths, runtimes, missing, progress)
        stages.add("latency", time.perf_counter() - t0)
        if model_part is not None and model_part.latency["cases"]:
            latency["cases"] += model_part.latency["cases"]
            errors = {r["name"]: r["error"] for r in model_part.latency["runtimes"] if r.get("error")}
            for r in latency["runtimes"]:
                if errors.get(r["name"]) and not r.get("error"):
                    r["error"] = f"{model_part.latency['layer']}: {errors[r['name']]}"

        # --- recommendations, findings and the document ---------------------------------------------
        # the one latency x accuracy join: stored in the document, the report renders these points
        points = join_points(latency["cases"], rows, config.baseline)
        recs, pareto = F.recommendations(points, target_db=config.target_db, baseline=config.baseline)
        model_doc = model_part.doc if model_part is not None else None
        found = F.findings(ranges, rows, recipes, model_doc, variants=config.variants)
        for a in artifacts:  # the paths the files will have once moved into place
            a["path"] = display_path(tx.final(a["path"]))
        from .document import build_document

        doc = build_document(config.to_dict(), specs, recipes, config.calib_tokens, config.eval_tokens, command, source,
                             model_doc, ranges, claims, rows, ort_baselines, artifacts, found, missing, latency, points,
                             recs, pareto, timed_claims, stages.seconds, time.perf_counter() - t_start)
        paths = write_report(doc, out_reports)
        paths["config"] = write_text(out_reports / "run.toml", config.to_toml())
        paths = {k: tx.final(p) for k, p in paths.items()}
    return RunResult(config, doc, paths)
