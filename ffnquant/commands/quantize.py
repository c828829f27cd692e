"""`ffnquant quantize`: quantize FFN variants under a scheme, write ONNX artifacts and an accuracy report."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..data import parse_source
from ..errors import FFNQuantError
from ..hf import EvalSettings, capture_layer_inputs, inspect_model, load_ffn_layers, parse_layers
from ..hf.capture import read_text, require_transformers
from ..hf.layers import check_recipes_per_call
from ..hf.memory import plan_memory, quantize_needs
from ..hf.stream import token_batches_of
from ..infra.atomic import OutputTransaction, write_json, write_text
from ..infra.envinfo import environment
from ..infra.render import agreement_words, fmt, ppl_change, text_table
from ..model import FFN
from ..numerics.calibrate import calibrator_names
from ..numerics.remedies import SMOOTH_SITES, smooth_exact_for
from ..planning import load_plan
from ..planning.planfile import Plan
from ..quantization import prepare, quantize_spec
from ..recipe import GRAMMAR, Recipe, as_recipe
from ..report.quantize import quantize_markdown, quantize_model_markdown
from ..schemes import preset_names
from .common import (StageBars, add_device_argument, add_memory_arguments, add_model_arguments, add_spec_arguments, positive_int,
                     specs_from_args, token_notes)

NAME = "quantize"
HELP = "quantize FFN variants (int8 / 4-bit / fp8) with calibration and remedies; write ONNX artifacts and an accuracy report"

__all__ = ["NAME", "HELP", "add_arguments", "recipe_from_args", "run"]


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # default swiglu, or none when --model is given (then only the model's layers are quantized)
    add_spec_arguments(parser, default_variants=None, default_note="default swiglu, or none when --model is given")
    parser.add_argument(
        "--recipe", default=None, metavar="RECIPE",
        help=f"what to quantize with, as `ffnquant run --schemes` writes it: {GRAMMAR}, e.g. 'w8a8@search+smooth+rotate' "
             "(or give the same with --scheme/--calibrator/--smooth/--rotate, not both)",
    )
    parser.add_argument("--scheme", default=None, help=f"scheme preset ({', '.join(preset_names())}); w8a8 when neither --scheme nor --recipe is given")
    parser.add_argument(
        "--calibrator", default=None,
        help=f"activation calibrator for static schemes ({', '.join(calibrator_names())}, percentile:P); default: the scheme's",
    )
    parser.add_argument("--smooth", type=float, default=None, metavar="ALPHA", help="SmoothQuant fold with strength ALPHA in [0, 1]")
    parser.add_argument(
        "--smooth-sites", default=None,
        help="comma-separated sites to smooth: input, hidden (default: every site the variant folds exactly)",
    )
    parser.add_argument("--rotate", action="store_true", help="block-Hadamard rotation of the hidden (exact in float)")
    parser.add_argument("--plan", default=None, metavar="FILE",
                        help="--model: a recipe per layer from `ffnquant plan` (plan.toml), instead of one recipe for all")
    parser.add_argument("--source", default="llm_like", help="token source: gaussian, llm_like or a .npy/.safetensors file")
    parser.add_argument("--calib-tokens", type=_non_negative_int, default=4096, help="calibration tokens (default 4096)")
    parser.add_argument("--eval-tokens", type=positive_int, default=2048, help="held-out evaluation tokens (default 2048)")
    parser.add_argument("--out-artifacts", default="export", help="folder for the ONNX artifacts (default export/)")
    parser.add_argument("--out-reports", default="reports", help="folder for the JSON and Markdown report (default reports/)")
    parser.add_argument("--no-onnx", action="store_true", help="torch reference only: no ONNX artifacts, no baseline")
    parser.add_argument("--latency", action="store_true", help="also time the artifacts on onnxruntime's CPU provider")
    parser.add_argument("--no-ablation", action="store_true",
                        help="--model: skip the per-layer end-to-end ablation (one extra model run per layer and "
                             "evaluation batch: most of the time on a deep model)")
    parser.add_argument("--no-progress", action="store_true", help="--model: no progress bars on stderr")
    add_model_arguments(parser, model_tokens=False, eval_text=True)
    add_memory_arguments(parser)
    add_device_argument(parser, "--model's model")


def recipe_from_args(args: argparse.Namespace) -> Recipe:
    """The one Recipe of the command: `--recipe TEXT` parsed, or built from the --scheme/--calibrator/--smooth/
    --rotate flags (the same Recipe the text would give); both forms at once is an error."""
    flags = [f for f, given in (("--scheme", args.scheme is not None), ("--calibrator", args.calibrator is not None),
                                ("--smooth", args.smooth is not None), ("--rotate", bool(args.rotate))) if given]
    if args.recipe is not None:
        if flags:
            raise FFNQuantError(f"--recipe {args.recipe!r} already says the scheme, calibrator and remedies: "
                                f"leave out {', '.join(flags)} (or give them without --recipe)")
        return Recipe.parse(args.recipe)
    if args.smooth is not None and not (math.isfinite(args.smooth) and 0.0 <= args.smooth <= 1.0):
        raise FFNQuantError(f"--smooth must be in [0, 1], got {args.smooth}")
    return Recipe(args.scheme if args.scheme is not None else "w8a8", args.calibrator, args.smooth, bool(args.rotate))


def _smooth_sites(args: argparse.Namespace, recipe: Recipe, specs: list):
    """The recipe checked against every spec to quantize, and the smooth sites (None: every exact one)."""
    for spec in specs:
        recipe.check_fits(spec)
    sites = None
    if args.smooth_sites is not None:
        if recipe.smooth is None:
            raise FFNQuantError("--smooth-sites needs smoothing: --smooth ALPHA or a recipe with +smooth")
        sites = [s.strip() for s in args.smooth_sites.split(",") if s.strip()]
        bad = [s for s in sites if s not in SMOOTH_SITES]
        if bad or not sites:
            raise FFNQuantError(f"unknown smooth site(s) {bad or sites}; valid: {', '.join(SMOOTH_SITES)}")
        if "hidden" in sites:
            for spec in specs:
                if not smooth_exact_for(FFN(spec))["hidden"]:
                    raise FFNQuantError(
                        f"--smooth-sites hidden: {spec.variant.value}'s {spec.activation.value} is not positively homogeneous, "
                        "so the fold would change the function; smooth the input only or use --rotate"
                    )
    return sites


def _validate(args: argparse.Namespace, recipe: Recipe):
    """Everything that can be wrong with the input, checked before anything is written."""
    specs = specs_from_args(args) if args.variants is not None else []
    sites = _smooth_sites(args, recipe, specs)
    scheme = recipe.resolve()
    needs_calib = scheme.static_activations or recipe.smooth is not None or scheme.needs_hessians
    if specs and needs_calib and args.calib_tokens == 0:
        raise FFNQuantError(f"recipe {recipe.name!r} needs calibration data: --calib-tokens is 0")
    source = parse_source(args.source, seed=args.seed)
    for spec in specs:  # a token file is read and checked (shape, NaN) here, before any output
        from ..data import calibration_and_eval

        cal, ev = calibration_and_eval(source, args.calib_tokens, args.eval_tokens, spec.d_model)
        calib = cal.tokens(args.calib_tokens, spec.d_model)
        import torch

        for what, x in (("calibration", calib), ("evaluation", ev)):
            if not torch.isfinite(x).all():
                raise FFNQuantError(f"{what} tokens from {source.label} contain NaN/Inf values")
    return specs, sites, source


def _check_model(args: argparse.Namespace, recipe: Recipe | None, info=None):
    """The model folder read and checked (config, weights index, architecture, the scheme against its
    widths, the texts or transformers): every model error fails here, before any work or output."""
    info = info if info is not None else inspect_model(args.model, allow_pickle=args.allow_pickle)
    info.check_selection(parse_layers(args.layers, info.n_layers))
    if recipe is not None:
        try:
            _smooth_sites(args, recipe, [info.spec])
            check_recipes_per_call(info, [recipe])
        except FFNQuantError as exc:
            raise FFNQuantError(f"--model {args.model}: {exc}") from None
    if args.calib_tokens == 0:
        raise FFNQuantError("--model needs calibration inputs from the model: --calib-tokens is 0")
    if args.captured is None:
        require_transformers()
        read_text(args.text, "calibration")
        read_text(args.eval_text, "evaluation")
    return info


def _memory_plan(args: argparse.Namespace, info, recipe):
    """How the model runs (whole, or layer by layer; `hf.memory.plan_memory`), decided before any work or output:
    a run that cannot fit is refused here with the numbers. None when the FFN inputs come from --captured files."""
    if info is None or args.captured is not None:
        if args.sequential is not None:
            raise FFNQuantError("--sequential/--no-sequential choose how a --model runs: give --model, without "
                                "--captured")
        return None

    settings = EvalSettings(max_calib_tokens=args.calib_tokens, max_eval_tokens=args.eval_tokens)
    calib = token_batches_of(info, args.text, "calibration", settings, args.calib_tokens)
    evals = token_batches_of(info, args.eval_text, "evaluation", settings, args.eval_tokens)
    recipes = recipe.layers.values() if isinstance(recipe, Plan) else [recipe]
    needs = quantize_needs(info, calib_tokens=sum(int(b.numel()) for b in calib),
                           eval_tokens=sum(int(b.numel()) for b in evals),
                           n_layers=len(parse_layers(args.layers, info.n_layers)), ablation=not args.no_ablation,
                           hessians=any(as_recipe(r).resolve().needs_hessians for r in recipes), onnx=not args.no_onnx,
                           batch_tokens=int(calib[0].numel()))
    return plan_memory(info, needs, max_memory=args.max_memory, sequential=args.sequential)


def _capture_model(args: argparse.Namespace, info, progress=None):
    """The selected FFN layers and their calibration and held-out inputs (model run or captured files)."""
    layers = load_ffn_layers(info, args.layers, allow_pickle=args.allow_pickle)
    settings = EvalSettings(max_calib_tokens=args.calib_tokens, max_eval_tokens=args.eval_tokens,
                            ablation=not args.no_ablation)
    inputs = capture_layer_inputs(info, layers, text=args.text, eval_text=args.eval_text, captured=args.captured,
                                  calib_tokens=args.calib_tokens, eval_tokens=args.eval_tokens, settings=settings,
                                  allow_pickle=args.allow_pickle, progress=progress)
    return layers, inputs, settings


def _fix_paths(entry_holder: dict, tx: OutputTransaction) -> None:
    """Staged artifact paths replaced by the paths the files will have once moved into place."""
    for key in ("artifact", "ort_default_baseline", "fp32"):
        entry = entry_holder.get(key) or {}
        if entry.get("path"):
            entry["path"] = str(tx.final(entry["path"]))


def _plan_from_args(args: argparse.Namespace):
    """(ModelInfo, Plan) for `--plan`: it needs --model, replaces the one-recipe flags, and must fit the model."""
    if not args.model:
        raise FFNQuantError("--plan needs --model: a plan holds a recipe per layer of one model")
    given = [f for f, v in (("--recipe", args.recipe), ("--scheme", args.scheme), ("--calibrator", args.calibrator),
                            ("--smooth", args.smooth), ("--smooth-sites", args.smooth_sites)) if v is not None]
    given += ["--rotate"] if args.rotate else []
    given += ["--variants"] if args.variants is not None else []
    if given:
        raise FFNQuantError(f"--plan gives each layer its recipe: leave out {', '.join(given)}")
    info = inspect_model(args.model, allow_pickle=args.allow_pickle)
    plan = load_plan(args.plan, info)
    if args.layers is None:
        args.layers = ",".join(str(i) for i in plan.layers)
    return info, plan


def run(args: argparse.Namespace) -> int:
    if args.plan is not None:
        info, recipe = _plan_from_args(args)
        _check_model(args, None, info)
    else:
        if args.variants is None and not args.model:
            args.variants = "swiglu"
        recipe = recipe_from_args(args)  # the command's one parse
        info = _check_model(args, recipe) if args.model else None
    specs, sites, source = _validate(args, recipe) if args.plan is None else ([], None, None)
    memory = _memory_plan(args, info, recipe)
    rows = []
    bars = StageBars(enabled=not args.no_progress)
    try:
        outputs = _quantize_all(args, recipe, info, specs, sites, source, rows, bars, memory)
    except BaseException:
        bars.close(ok=False)
        raise
    bars.close()
    _print_results(rows, outputs)
    if memory is not None:
        print(f"memory: {memory.summary()}")
    return 0


def _quantize_all(args, recipe, info, specs, sites, source, rows, bars, memory) -> list:
    # Artifacts and reports are staged beside their folders and moved into place only when every variant
    # and layer succeeded: a failure or Ctrl-C leaves both folders as they were.
    with OutputTransaction() as tx:
        arts = None if args.no_onnx else tx.folder(args.out_artifacts)
        reports = tx.folder(args.out_reports)
        # a causal LM runs through the engine (whole or a layer at a time); encoders, and FFN inputs from
        # --captured files, are captured whole first
        from ..hf import ModelKind

        engine = memory is not None and info.kind is ModelKind.CAUSAL_LM
        model_part = _capture_model(args, info, bars) if info is not None and not engine else None
        outputs: list[tuple[str, dict, object]] = []
        for spec in specs:
            prep = prepare(spec, source, args.calib_tokens, args.eval_tokens, args.seed, smooth_sites=sites, recipe=recipe)
            res = quantize_spec(spec, recipe, prep, out_artifacts=arts, onnx=not args.no_onnx, latency=args.latency)
            outputs.append((f"{spec.key}.{recipe.slug}", res.to_dict(), quantize_markdown))
        if info is not None:
            from ..hf import EvalSettings, model_file_stem, quantize_model_layers

            stem = model_file_stem(info)
            if engine:  # capture, quantize and end to end in one pass over the decoder layers
                from ..hf.layerwise import quantize_layerwise

                settings = EvalSettings(max_calib_tokens=args.calib_tokens, max_eval_tokens=args.eval_tokens,
                                        ablation=not args.no_ablation)
                data = quantize_layerwise(info, recipe, args.layers, args.text, args.eval_text, args.calib_tokens,
                                          args.eval_tokens, settings, smooth_sites=sites, out_artifacts=arts,
                                          onnx=not args.no_onnx, latency=args.latency, file_stem=stem,
                                          resident=not memory.sequential, spill=memory.spill,
                                          allow_pickle=args.allow_pickle, progress=bars)
            else:
                layers, inputs, settings = model_part
                data = quantize_model_layers(info, layers, inputs, recipe, smooth_sites=sites, out_artifacts=arts,
                                             onnx=not args.no_onnx, latency=args.latency, settings=settings,
                                             file_stem=stem, progress=bars)
            data = {"command": "ffnquant quantize --model", "layers_selected": args.layers, **data,
                    "memory": memory.to_dict() if memory is not None else None, "environment": environment()}
            tag = recipe.slug if args.plan is None else "plan-" + Path(args.plan).stem
            outputs.append((f"{stem}.{tag}", data, quantize_model_markdown))
        for tag, data, render in outputs:
            for holder in data["layers"] if "layers" in data else [data]:
                _fix_paths(holder, tx)
            json_path = tx.final(write_json(reports / f"quantize_{tag}.json", data))
            write_text(reports / f"quantize_{tag}.md", render(data))
            for label, r in ([(f"{info.model_type}:{r['label']}" + (f" (= {r['shares']})" if r.get("shares") else ""), r)
                              for r in data["layers"]] if "layers" in data
                             else [(data["spec"]["variant"], data)]):
                art = r.get("artifact") or {}
                base = r.get("ort_default_baseline") or {}
                rows.append((
                    label, r["scheme"]["name"] if args.plan is None else r["recipe"], r["calibrator"] or "-",
                    r["accuracy_torch"]["sqnr_db"],
                    (art.get("accuracy_onnx") or {}).get("sqnr_db"),
                    (base.get("accuracy_onnx") or {}).get("sqnr_db"),
                    art.get("size_bytes"), art.get("path") or "-", str(json_path),
                ))
    return outputs


def _print_results(rows: list, outputs: list) -> None:
    print(text_table(["variant", "scheme", "calibrator", "SQNR torch", "SQNR ONNX", "SQNR ORT default", "bytes", "artifact", "report"], rows))
    for tag, data, _ in outputs:
        if "calibration" in data:  # a model's layers: which texts, how many tokens (and whether fewer than asked)
            for part in ("calibration", "evaluation"):
                per_layer = list(data[part]["tokens_per_layer"].values())
                count = f"{min(per_layer):,}" + (f" to {max(per_layer):,}" if min(per_layer) != max(per_layer) else "")
                print(f"{part}: {count} tokens per layer from {data[part]['source']}")
            shared = [f"{r['label']} calls {r['shares']}'s" for r in data["layers"] if r.get("shares")]
            if shared and any(r.get("own_inputs") for r in data["layers"]):  # each call with its own adapters
                print(f"shared FFNs: {', '.join(shared)} (one set of weights, each call with its own adapters): each "
                      "call quantized through its own adapters from every call's calibration statistics merged, to "
                      "the same weights and ranges (checked bit for bit), and measured on its own held-out inputs")
            elif shared:  # "(= L0)": the layer calls L0's FFN again, quantized once from all their inputs
                print(f"shared FFNs: {', '.join(shared)} (one set of weights): each quantized once, from the inputs of "
                      "all its selected calls (the token counts above include them all)")
            for line in token_notes([data["calibration"].get("tokens"), data["evaluation"].get("tokens")]):
                print(line)
            secs = [r["seconds"] for r in data["layers"] if r.get("seconds") is not None]
            if secs:
                print(f"time: {sum(secs) / len(secs):.2f} s per layer ({len(secs)} layers, {sum(secs):.1f} s)"
                      + (f", end to end {data['end_to_end']['seconds']:.1f} s" if data["end_to_end"].get("seconds") else ""))
        e2e = data.get("end_to_end")
        if e2e is None:
            continue
        if e2e["status"] != "ok":
            print(f"end to end: not measured ({e2e['reason']})")
            continue
        e, base = e2e["end_to_end"], e2e["baseline"]
        line = (f"end to end, {len(data['layers'])} FFN layer(s) quantized: final hidden SQNR {fmt(e['hidden_sqnr_db'])} dB, "
                f"cosine {fmt(e['hidden_cosine'])}")
        if "perplexity" in e:
            line += f", perplexity {fmt(base['perplexity'])} -> {fmt(e['perplexity'])}, {ppl_change(e)}; {agreement_words(e)}"
        if e2e["worst_layers_end_to_end"]:
            line += f"; hurts most: {', '.join(e2e['worst_layers_end_to_end'])}"
        elif data.get("ablation") is False and len(data["layers"]) > 1:
            line += "; per-layer ablation skipped (--no-ablation)"
        print(line)
