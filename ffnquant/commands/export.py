"""`ffnquant export`: fp32 and fp16 ONNX for each variant, parity-checked against torch."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..atomic import OutputTransaction
from ..export import DEFAULT_OPSET, export_spec
from ..render import text_table
from .common import add_spec_arguments, add_text_arguments, specs_from_args

NAME = "export"
HELP = "export FFN variants to fp32/fp16 ONNX and check them against torch on onnxruntime; with --model --plan, a model's planned quantized FFN layers"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_spec_arguments(parser)
    parser.add_argument("--out", default="export", help="output folder (default export/)")
    parser.add_argument("--dtypes", default="fp32,fp16", help="comma-separated: fp32, fp16 (default fp32,fp16)")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset, >= 17 (default {DEFAULT_OPSET})")
    group = parser.add_argument_group("a model's FFN layers as planned (ffnquant plan)")
    group.add_argument("--model", default=None, metavar="DIR", help="a local Hugging Face model folder; needs --plan")
    group.add_argument("--plan", default=None, metavar="FILE", help="plan.toml from `ffnquant plan`: a recipe per layer")
    add_text_arguments(group, "calibration text for the static ranges", "held-out text the manifest's SQNR is measured on")


def _export_plan(args: argparse.Namespace) -> int:
    """Each FFN layer of the model quantized with its planned recipe as an ONNX artifact in --out, with
    manifest.json (layer -> file, recipe, input/output names, measured SQNR) and the end-to-end figures."""
    from ..atomic import write_json
    from ..envinfo import environment
    from ..errors import FFNQuantError
    from ..hf import EvalSettings, capture_layer_inputs, inspect_model, load_ffn_layers, model_file_stem, quantize_model_layers
    from ..hf.capture import read_text, require_transformers
    from ..plan import load_plan

    if args.plan is None or args.model is None:
        raise FFNQuantError("--model and --plan go together: export writes a model's FFN layers as its plan says")
    info = inspect_model(args.model)
    plan = load_plan(args.plan, info)
    require_transformers()
    read_text(args.text, "calibration")
    read_text(args.eval_text, "evaluation")
    layers = [l for l in load_ffn_layers(info, "all") if l.index in plan.layers]
    settings = EvalSettings(max_calib_tokens=args.calib_tokens, max_eval_tokens=args.eval_tokens, ablation=False)
    with OutputTransaction() as tx:
        out = tx.folder(args.out)
        inputs = capture_layer_inputs(info, layers, text=args.text, eval_text=args.eval_text,
                                      calib_tokens=args.calib_tokens, eval_tokens=args.eval_tokens, settings=settings)
        data = quantize_model_layers(info, layers, inputs, plan, out_artifacts=out, onnx=True, sensitivity=False,
                                     settings=settings, file_stem=model_file_stem(info))
        manifest = {
            "model": data["model"], "plan": plan.to_dict(), "plan_file": str(args.plan),
            "layers": [{"index": r["index"], "label": r["label"], "recipe": r["recipe"],
                        "file": Path(tx.final(r["artifact"]["path"])).name if (r.get("artifact") or {}).get("path") else None,
                        "why_no_file": None if (r.get("artifact") or {}).get("path") else (r.get("artifact") or {}).get("note"),
                        "inputs": ["input"], "outputs": ["output"], "input_shape": ["batch", "seq", info.spec.d_model],
                        "sqnr_db_torch": r["accuracy_torch"]["sqnr_db"],
                        "sqnr_db_onnx": ((r.get("artifact") or {}).get("accuracy_onnx") or {}).get("sqnr_db")}
                       for r in data["layers"]],
            "end_to_end": data["end_to_end"], "evaluation": data["evaluation"]["source"],
            "environment": environment(),
        }
        write_json(out / "manifest.json", manifest)
        final = tx.final(out / "manifest.json")
    rows = [(m["label"], m["recipe"], m["file"] or f"- ({m['why_no_file']})", m["sqnr_db_torch"], m["sqnr_db_onnx"])
            for m in manifest["layers"]]
    print(text_table(["layer", "recipe", "file", "SQNR torch", "SQNR ONNX"], rows))
    e2e = data["end_to_end"]
    if e2e.get("status") == "ok":
        e = e2e["end_to_end"]
        print(f"end to end (torch reference): perplexity {e2e['baseline'].get('perplexity')} -> {e.get('perplexity')}, "
              f"final hidden SQNR {e['hidden_sqnr_db']:.2f} dB")
    print(f"manifest: {final}")
    return 0


def run(args: argparse.Namespace) -> int:
    from ..errors import FFNQuantError

    if args.model is not None or args.plan is not None:
        return _export_plan(args)
    specs = specs_from_args(args)  # validate everything before writing anything
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in ("fp32", "fp16")]
    if bad or not dtypes:
        raise FFNQuantError(f"unknown dtype(s) {bad or dtypes}; valid: fp32, fp16")
    if args.opset < 17:
        raise FFNQuantError(f"--opset must be >= 17, got {args.opset}")
    rows = []
    # every file is staged and moved into place only once all passed parity: a failure leaves --out as it was
    with OutputTransaction() as tx:
        out = tx.folder(args.out)
        for spec in specs:
            result = export_spec(spec, out, dtypes=dtypes, seed=args.seed, opset=args.opset)
            for dtype in dtypes:
                check = result.parity[dtype]
                rows.append(
                    (spec.variant.value, dtype, str(tx.final(result.paths[dtype])), check.max_abs_error, check.tolerance,
                     "pass" if check.passed else "FAIL", check.provider)
                )
    print(text_table(["variant", "dtype", "file", "max |onnx - torch|", "tolerance", "parity", "provider"], rows))
    return 0
