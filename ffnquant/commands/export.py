"""`ffnquant export`: fp32 and fp16 ONNX for each variant, parity-checked against torch."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..deploy import build_planned_model
from ..deploy.formats import get_format
from ..deploy.precision import resolve_compute_dtype
from ..errors import FFNQuantError
from ..hf import inspect_model, model_file_stem
from ..hf.capture import read_text, require_transformers
from ..hf.memory import export_memory_refusal
from ..infra.atomic import OutputTransaction
from ..infra.atomic_folder import check_new_folder, staged_folder
from ..infra.render import text_table
from ..onnx.export import DEFAULT_OPSET, export_spec
from ..planning import load_plan
from ..report.deploy import decoder_summary, experts_line, fold_line, gate_rows, target_verdict
from ..wholemodel import DEPLOY_DOC, format_refusal, set_aside_unproven, write_deployment
from .common import (StageBars, add_device_argument, add_spec_arguments, add_text_arguments, memory_size, specs_from_args,
                     text_files, text_options, token_notes)

NAME = "export"
HELP = ("export FFN variants to fp32/fp16 ONNX and check them against torch on onnxruntime; with --model --plan, "
        "the model quantized as planned, as ONNX or as a compressed-tensors folder that transformers and vLLM load")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_spec_arguments(parser)
    parser.add_argument("--out", default=None, help="output folder: export/ if omitted; required with --model")
    # None when not given: a --plan export refuses them rather than ignore them
    parser.add_argument("--dtypes", default=None, help="comma-separated: fp32, fp16 (both when not given); not with --plan")
    parser.add_argument("--opset", type=int, default=None,
                        help=f"ONNX opset, >= 17 ({DEFAULT_OPSET} when not given); not with --plan")
    group = parser.add_argument_group("a model quantized as planned (ffnquant plan)")
    group.add_argument("--model", default=None, metavar="DIR", help="a local Hugging Face model folder; needs --plan")
    group.add_argument("--plan", default=None, metavar="FILE", help="plan.toml from `ffnquant plan`: a recipe per layer")
    group.add_argument("--format", default=None, metavar="NAME",
                       help="onnx (default: per-layer artifacts, manifest.json and the whole-model graph) or "
                            "compressed-tensors (a Hugging Face folder transformers and vLLM load)")
    group.add_argument("--compute-dtype", default="auto", metavar="NAME",
                       help="what the deployed model computes in, which the reference and the proof use: float32, "
                            "bfloat16 or float16; auto is the checkpoint's own dtype for compressed-tensors (a bf16 "
                            "checkpoint is served in bf16) and float32 for onnx (default auto)")
    group.add_argument("--force", action="store_true", help="replace --out if it holds an earlier export (only the files its ffnquant-deploy.json lists)")
    group.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    add_device_argument(group)
    group.add_argument("--max-memory", type=memory_size, default=None, metavar="SIZE",
                       help="memory the export may use in all, e.g. 16GB (default: what the process holds plus what "
                            "the machine has available); export holds the whole model, and refuses one estimated "
                            "not to fit before reading it")
    add_text_arguments(group, "calibration text for the static ranges (the plan's)",
                       "held-out text the deployed model is checked on", eval_tokens=4096)


# Options each kind of export reads (flag -> (dest, value when not given)): the other kind refuses them.
_FFN_ONLY = {"--dtypes": ("dtypes", None), "--opset": ("opset", None), "--variants": ("variants", "all"),
             "--d-model": ("d_model", 512), "--d-ff": ("d_ff", None), "--multiple-of": ("multiple_of", None),
             "--ffn-dim-multiplier": ("ffn_dim_multiplier", None), "--bias/--no-bias": ("bias", None),
             "--seed": ("seed", 0)}
_PLAN_ONLY = {"--format": ("format", None), "--force": ("force", False), "--compute-dtype": ("compute_dtype", "auto"),
              "--text": ("text", None), "--eval-text": ("eval_text", None), "--calib-tokens": ("calib_tokens", None),
              "--calib-samples": ("calib_samples", None), "--eval-tokens": ("eval_tokens", 4096),
              "--seq-len": ("seq_len", None), "--chat-template": ("chat_template", False),
              "--no-progress": ("no_progress", False), "--device": ("device", "auto"),
              "--target-model": ("target_model", None), "--max-memory": ("max_memory", None)}


def _given(args: argparse.Namespace, options: dict) -> list[str]:
    """The options among `options` that were given a value other than their default."""
    return [flag for flag, (dest, default) in options.items() if getattr(args, dest, default) != default]


def _are(flags: list[str]) -> str:
    return f"{flags[0]} is an option" if len(flags) == 1 else f"{', '.join(flags)} are options"


def _export_plan(args: argparse.Namespace) -> int:
    """The model quantized as the plan says, into --out as one format (`deploy.formats`), with the document
    (`ffnquant-deploy.json`/`.md`) that says what was written and what it measures; nothing half-written."""
    import shlex

    if args.plan is None or args.model is None:
        raise FFNQuantError("--model and --plan go together: export writes a model's FFN layers as its plan says")
    if args.out is None:
        raise FFNQuantError("--out is required with --model: the folder the quantized model is written to")
    unused = _given(args, _FFN_ONLY)
    if unused:
        raise FFNQuantError(f"{_are(unused)} of FFN variant exports, not read by --model --plan exports (which "
                            "write the plan's recipes, at their own opset and dtypes); leave them out")
    fmt = get_format("onnx" if args.format is None else args.format)  # '' is no format name
    info = inspect_model(args.model)
    plan = load_plan(args.plan, info)
    whole, graph_why = format_refusal(info, plan, fmt)

    why = export_memory_refusal(info, args.max_memory)
    if why is not None:
        raise FFNQuantError(why)
    dtype = resolve_compute_dtype(args.compute_dtype, fmt, info)
    require_transformers()
    texts = text_options(args, info)
    read_text(texts.text, "calibration")
    read_text(texts.eval_text, "evaluation")
    # never into the model's own folder, nor over the plan or a text file it reads
    # --force replaces only what an earlier export listed in its ffnquant-deploy.json, never other files
    check_new_folder(args.out, args.force, inputs=[args.model, args.plan, *text_files(texts)], listing=DEPLOY_DOC)
    command = "ffnquant " + " ".join(shlex.quote(a) for a in getattr(args, "_argv", []))
    bars = StageBars(enabled=not getattr(args, "no_progress", False))
    with bars, staged_folder(args.out, args.force, listing=DEPLOY_DOC) as folder:
        planned = build_planned_model(info, plan, text=texts.text, eval_text=texts.eval_text,
                                      calib_tokens=texts.calib_tokens, eval_tokens=texts.eval_tokens,
                                      seq_len=texts.seq_len, whole_model=whole,
                                      out_artifacts=folder if fmt == "onnx" else None, file_stem=model_file_stem(info),
                                      progress=bars, dtype=dtype, fmt=fmt)
        doc = write_deployment(planned, folder, fmt, whole=whole, graph_why=graph_why, command=command,
                               plan_file=str(args.plan), progress=bars)
    _print_deploy(doc, Path(args.out))
    if fmt == "compressed-tensors" and not doc["proof"]["proven"]:
        why = "; ".join(doc["proof"].get("unproven") or []) or "the folder does not reproduce the measured model"
        kept = set_aside_unproven(Path(args.out))  # nothing deployable-looking is left at --out
        print(f"NOT PROVEN: {why}; the folder is kept as {kept} (the evidence, not a deployment: see its "
              "ffnquant-deploy.md)")
        return 1
    return 0


def _print_deploy(doc: dict, out: Path) -> None:
    verdict = target_verdict(doc)
    if verdict:  # the plain answer first, then the details
        print(verdict)
    rows = [(m["label"], m["recipe"], m["sqnr_db_torch"], m.get("file") or "-") for m in doc["layers"]]
    print(text_table(["layer", "recipe", "SQNR torch", "file"], rows))
    for line in token_notes((doc.get("token_budgets") or {}).values()):  # a shrunk text is said here, not only in the report
        print(line)
    ref, base = doc["reference"], doc["baseline"]
    print(f"ffnquant's torch reference: perplexity {base.get('perplexity'):.4f} -> {ref.get('perplexity'):.4f}, "
          f"final hidden SQNR {ref['hidden_sqnr_db']:.2f} dB")
    if doc.get("fold"):
        print(fold_line(doc["fold"]))
    if doc.get("proof") and doc["proof"].get("not_loaded"):
        print(doc["proof"]["not_loaded"])
    elif doc.get("proof"):
        proof = doc["proof"]
        load, w, lay = proof["load"], proof["weights"], proof["layers"]
        print(f"weights: {w['bit_identical']}/{w['modules']} FFN weights decompressed bit-identical; static input "
              f"qparams {'equal' if proof['inputs']['all_equal'] else 'DIFFER'}; layers on the same inputs: "
              f"{lay['bit_identical']}/{lay['layers']} bit-identical, "
              f"{'all' if lay['all_at_parity'] else 'NOT all'} within rounding ties")
        gen = proof.get("generation") or {}
        if gen.get("skipped"):
            print(f"generation not compared: {gen['skipped']}")
        elif gen:
            print(f"generation with transformers' KV cache: {gen['equal']}/{gen['prompts']} prompts x {gen['new_tokens']} "
                  "tokens equal to ffnquant's reference")
        dtype = load.get("compute_dtype", "float32")
        if load.get("decompressed_because"):  # its compressed modules refused; its files loaded decompressed
            print(f"transformers cannot run this model's compressed modules ({load['decompressed_because']}): loaded "
                  "decompressed (CompressedTensorsConfig(run_compressed=False)), as a transformers user must load it")
        needs = [why for key, why in (
            ("per_expert_loading", "its routed experts are stored per expert, and transformers alone has no conversion "
                                   "for them"),
            ("float_converters_kept", "transformers alone adds its dequantization to the model's conversions of "
                                      "tensors stored in float, and fails on them")) if load.get(key)]
        if needs:  # transformers' from_pretrained alone does not load it as written
            print(f"load the folder inside `with ffnquant.deploy.transformers_loading(folder):` ({'; '.join(needs)})")
        print(f"loaded back with transformers ({dtype}), against the original float model: perplexity {load['perplexity']:.4f} "
              f"({load.get('relative_difference', float('nan')):.1e} relative to the reference)")
        gates = load.get("gates")
        if gates:
            print("end-to-end gates, each against ffnquant's reference on the original float model; allowed: twice "
                  f"what {dtype} rounding alone moves it (the original, unfolded model), or {load['tolerance']:.0e} "
                  "relative")
            print(text_table(["gate", "deployed", "reference", "worse by", "allowed", "met"], gate_rows(gates)))
            if gates.get("convention"):
                print(f"  reference computed with {gates['convention']}, as the folder runs it")
            if (load.get("allowance") or {}).get("deterministic") is False:
                print("  the original model's forward draws at random (two runs on the same text differ): the "
                      "reference is one draw, and the allowed spread holds the draws")
            if not gates["reproduces_reference"]:
                print("  the rounding allowance's plain run did not reproduce ffnquant's recorded reference: NOT met")
    graph = doc.get("graph") or {}
    if graph.get("status") == "ok" and graph.get("score"):
        sc = graph["score"]
        print(f"whole-model ONNX graph on onnxruntime ({sc['provider']}): perplexity "
              f"{sc.get('graph', sc['onnx'])['perplexity']:.4f} "
              f"({100 * sc['perplexity_rel_diff']:+.3f}% against the reference; bound {100 * sc['tolerance']:.1f}%: "
              f"{'met' if sc['meets_tolerance'] else 'NOT met'})")
        experts = experts_line((graph.get("quantize") or {}).get("experts") or {})
        if experts:
            print(f"  {experts}")
        if "graph" in sc:
            print(f"  as it runs here: perplexity {sc['onnx']['perplexity']:.4f}; {sc['int8_kernel']}")
        if sc.get("resolution"):
            print(f"  float32 rounding alone moves this plan's perplexity by up to "
                  f"{sc['resolution']['spread']['perplexity_ratio']:.1e} on this text (the original, unfolded model): "
                  f"{'within' if sc['within_resolution'] else 'BEYOND'} twice that")
        for n, r in (graph.get("latency") or {}).get("tokens", {}).items():
            print(f"  {n} tokens: fp32 graph {r['float']['p50_ms']:.2f} ms, quantized {r['quantized']['p50_ms']:.2f} ms "
                  f"(p50; {r['speedup']:.2f}x)")
        for line in decoder_summary(graph.get("decoder") or {}, sc.get("cached")):
            print(f"  {line}")
    elif graph:
        print(f"whole-model ONNX graph: not written ({graph.get('reason')})")
    print(f"weights {doc['sizes']['weights']:,} bytes against {doc['sizes']['float_weights']:,} for the float folder")
    print(f"written: {out}/ (ffnquant-deploy.md says what it measures)")


def run(args: argparse.Namespace) -> int:
    if args.model is not None or args.plan is not None:
        return _export_plan(args)
    unused = _given(args, _PLAN_ONLY)
    if unused:
        raise FFNQuantError(f"{_are(unused)} of --model --plan exports; give --model and --plan, or leave "
                            f"{'it' if len(unused) == 1 else 'them'} out")
    args.out = args.out or "export"
    args.dtypes = "fp32,fp16" if args.dtypes is None else args.dtypes
    args.opset = DEFAULT_OPSET if args.opset is None else args.opset
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
