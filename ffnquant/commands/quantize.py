"""`ffnquant quantize`: quantize FFN variants under a scheme, write ONNX artifacts and an accuracy report."""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
from pathlib import Path

from ..atomic import ensure_writable_dir, write_json, write_text
from ..errors import FFNQuantError
from ..render import fmt, markdown_table, text_table
from .common import add_spec_arguments, positive_int, specs_from_args

NAME = "quantize"
HELP = "quantize FFN variants (int8 / 4-bit / fp8) with calibration and remedies; write ONNX artifacts and an accuracy report"

__all__ = ["NAME", "HELP", "add_arguments", "run", "render_markdown"]


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..calibrate import calibrator_names
    from ..schemes import preset_names

    add_spec_arguments(parser, default_variants="swiglu")
    parser.add_argument("--scheme", default="w8a8", help=f"scheme preset ({', '.join(preset_names())})")
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
    parser.add_argument("--source", default="llm_like", help="token source: gaussian, llm_like or a .npy/.safetensors file")
    parser.add_argument("--calib-tokens", type=_non_negative_int, default=4096, help="calibration tokens (default 4096)")
    parser.add_argument("--eval-tokens", type=positive_int, default=2048, help="held-out evaluation tokens (default 2048)")
    parser.add_argument("--out-artifacts", default="export", help="folder for the ONNX artifacts (default export/)")
    parser.add_argument("--out-reports", default="reports", help="folder for the JSON and Markdown report (default reports/)")
    parser.add_argument("--no-onnx", action="store_true", help="torch reference only: no ONNX artifacts, no baseline")
    parser.add_argument("--latency", action="store_true", help="also time the artifacts on onnxruntime's CPU provider")


def _validate(args: argparse.Namespace):
    """Everything that can be wrong with the input, checked before anything is written."""
    from ..calibrate import parse_calibrator
    from ..data import parse_source
    from ..schemes import check_scheme_fits, get_scheme
    from ..remedies import SMOOTH_SITES, smooth_exact_for
    from ..model import FFN

    specs = specs_from_args(args)
    scheme = get_scheme(args.scheme)
    if args.calibrator is not None:
        scheme = scheme.with_(calibrator=parse_calibrator(args.calibrator).name)
    for spec in specs:
        check_scheme_fits(scheme, spec)
    if args.smooth is not None and not (math.isfinite(args.smooth) and 0.0 <= args.smooth <= 1.0):
        raise FFNQuantError(f"--smooth must be in [0, 1], got {args.smooth}")
    sites = None
    if args.smooth_sites is not None:
        if args.smooth is None:
            raise FFNQuantError("--smooth-sites needs --smooth ALPHA")
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
    needs_calib = scheme.static_activations or args.smooth is not None or scheme.method.value == "gptq"
    if needs_calib and args.calib_tokens == 0:
        raise FFNQuantError(f"scheme {scheme.name!r}{' with --smooth' if args.smooth is not None else ''} needs calibration data: --calib-tokens is 0")
    source = parse_source(args.source, seed=args.seed)
    for spec in specs:  # a token file is read and checked (shape, NaN) here, before any output
        from ..data import calibration_and_eval

        cal, ev = calibration_and_eval(source, args.calib_tokens, args.eval_tokens, spec.d_model)
        calib = cal.tokens(args.calib_tokens, spec.d_model)
        import torch

        for what, x in (("calibration", calib), ("evaluation", ev)):
            if not torch.isfinite(x).all():
                raise FFNQuantError(f"{what} tokens from {source.label} contain NaN/Inf values")
    return specs, scheme, sites, source


def _tag(result) -> str:
    parts = [result.spec.key, result.scheme.name]
    if result.calibrator:
        parts.append(result.calibrator.replace(":", ""))
    for r in result.remedies:
        parts.append(f"smooth{r.params['alpha']:g}" if r.kind == "smooth" else r.kind)
    return "_".join(parts)


def render_markdown(data: dict) -> str:
    """The Markdown summary of one `QuantResult.to_dict()`."""
    spec, scheme = data["spec"], data["scheme"]
    lines = [
        f"# ffnquant quantize: {spec['variant']} d={spec['d_model']} d_ff={spec['d_ff']}, scheme {scheme['name']}",
        "",
        f"- data: {data['source']}; {data['n_calib_tokens']} calibration tokens, {data['n_eval_tokens']} held-out evaluation tokens",
        f"- calibrator: {data['calibrator'] or '-'}; remedies: "
        + (", ".join(f"{r['kind']} {r['params']}" + (f" ({r['note']})" if r["note"] else "") for r in data["remedies"]) or "none"),
        "",
        "## Accuracy against fp32 (held-out tokens)",
        "",
    ]
    rows = [("torch reference", *[data["accuracy_torch"][k] for k in ("sqnr_db", "cosine", "rel_l2", "max_abs_error")], None, None)]
    art = data.get("artifact") or {}
    if art.get("accuracy_onnx"):
        a = art["accuracy_onnx"]
        rows.append((f"ONNX artifact ({art['kind']})", a["sqnr_db"], a["cosine"], a["rel_l2"], a["max_abs_error"], art.get("size_bytes"), art.get("latency_ms")))
    base = data.get("ort_default_baseline") or {}
    if base.get("accuracy_onnx"):
        a = base["accuracy_onnx"]
        rows.append(("ORT default quantize_static", a["sqnr_db"], a["cosine"], a["rel_l2"], a["max_abs_error"], base.get("size_bytes"), base.get("latency_ms")))
    fp32 = data.get("fp32") or {}
    if fp32:
        rows.append(("fp32 ONNX", None, None, None, None, fp32.get("size_bytes"), fp32.get("latency_ms")))
    lines.append(markdown_table(["model", "SQNR dB", "cosine", "rel L2", "max abs err", "bytes", "ORT CPU ms"], rows))
    if art and not art.get("accuracy_onnx"):
        lines += ["", f"No ONNX artifact: {art.get('note')}."]
    if data["ranges"]:
        lines += ["", "## Activation ranges per site", ""]
        lines.append(markdown_table(
            ["site", "calibrator", "lo", "hi", "observed min", "observed max", "scale", "zero point"],
            [(s, r["calibrator"], r["lo"], r["hi"], r["observed_min"], r["observed_max"], r["scale"], r["zero_point"]) for s, r in data["ranges"].items()],
        ))
    if data["sensitivity_sqnr_db"]:
        lines += ["", "## Where the error comes from (SQNR with only this one quantized)", ""]
        lines.append(markdown_table(["quantized alone", "SQNR dB"], sorted(data["sensitivity_sqnr_db"].items(), key=lambda kv: kv[1])))
    env = data["environment"]
    lines += ["", f"_{env.get('timestamp_utc')} on {env.get('cpu')}, torch {env['packages'].get('torch')}, onnxruntime {env['packages'].get('onnxruntime-gpu') or env['packages'].get('onnxruntime')}_", ""]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from ..quantize import prepare, quantize_spec

    specs, scheme, sites, source = _validate(args)
    ensure_writable_dir(args.out_artifacts)
    ensure_writable_dir(args.out_reports)
    rows = []
    # artifacts are built in a scratch folder and moved only when every variant succeeded
    with tempfile.TemporaryDirectory(prefix="ffnquant-quantize-") as tmp:
        outputs: list[tuple[str, dict]] = []
        for spec in specs:
            prep = prepare(spec, source, args.calib_tokens, args.eval_tokens, args.seed, args.smooth, sites, args.rotate)
            res = quantize_spec(
                spec, scheme, prepared=prep, out_artifacts=None if args.no_onnx else tmp, onnx=not args.no_onnx, latency=args.latency
            )
            outputs.append((_tag(res), res.to_dict()))
        moved: dict[str, str] = {}
        for f in sorted(Path(tmp).glob("*.onnx")):
            dest = Path(args.out_artifacts) / f.name
            shutil.move(str(f), str(dest) + ".partial")
            moved[str(f)] = str(dest)
        for src, dest in moved.items():
            Path(dest + ".partial").replace(dest)
        for tag, data in outputs:
            for key in ("artifact", "ort_default_baseline", "fp32"):
                entry = data.get(key) or {}
                if entry.get("path"):
                    entry["path"] = moved.get(entry["path"], entry["path"])
            json_path = write_json(Path(args.out_reports) / f"quantize_{tag}.json", data)
            md_path = write_text(Path(args.out_reports) / f"quantize_{tag}.md", render_markdown(data))
            art = data.get("artifact") or {}
            base = data.get("ort_default_baseline") or {}
            rows.append((
                data["spec"]["variant"], data["scheme"]["name"], data["calibrator"] or "-",
                data["accuracy_torch"]["sqnr_db"],
                (art.get("accuracy_onnx") or {}).get("sqnr_db"),
                (base.get("accuracy_onnx") or {}).get("sqnr_db"),
                art.get("size_bytes"), art.get("path") or "-", str(json_path),
            ))
    print(text_table(["variant", "scheme", "calibrator", "SQNR torch", "SQNR ONNX", "SQNR ORT default", "bytes", "artifact", "report"], rows))
    return 0
