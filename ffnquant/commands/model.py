"""`ffnquant model`: a local Hugging Face model's FFN layers (inspect, capture, eval)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from ..adequacy import model_adequacy
from ..errors import FFNQuantError
from ..hf import inspect_model, load_ffn_layers, parse_layers
from ..hf.evaluate import EvalSettings, evaluate_model
from ..infra.atomic import OutputTransaction, write_json, write_text
from ..infra.envinfo import environment
from ..infra.render import agreement_words, display_path, fmt, ppl_change, text_table
from ..recipe import GRAMMAR, parse_recipe
from ..model import OWN_ACTIVATIONS
from ..report.adequacy import adequacy_markdown, summary_paragraph
from ..report.model import model_eval_markdown, recipe_name
from .common import TextFiles, add_device_argument, add_target_argument, positive_int, token_notes

NAME = "model"
HELP = ("FFN layers of a local Hugging Face model: inspect, capture inputs, evaluate schemes end to end, "
        "check the calibration set")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="model_command", metavar="ACTION")
    sub.required = True

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("path", help="model folder (config.json + model.safetensors or a sharded index)")
        p.add_argument("--layers", default="all", help="layers: all, a range 0-3, a list 0,5,7 (default all)")
        p.add_argument("--allow-pickle", action="store_true",
                       help="read a .bin/.pt checkpoint with torch.load(weights_only=True); only for files you trust")

    p = sub.add_parser("inspect", help="detected architecture, variant, sizes and layers (reads no weights)")
    common(p)
    p.set_defaults(_action=_inspect)

    p = sub.add_parser("capture", help="run the model on a text and save each FFN's input as <label>.npy (needs transformers)")
    common(p)
    p.add_argument("--text", default=None, action=TextFiles,
                   help="text file; several: repeat or comma-separate (default: the shipped calibration sample)")
    p.add_argument("--out", required=True, help="output folder for <label>.npy files")
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument("--max-tokens", type=positive_int, default=4096)
    p.set_defaults(_action=_capture)

    p = sub.add_parser("eval", help="quantize the FFNs per scheme; perplexity / hidden-state SQNR and per-layer SQNR (needs transformers)")
    common(p)
    p.add_argument("--schemes", default="w8a8,w8a8-dynamic,w4a16-g128",
                   help=f"comma-separated recipes, as `ffnquant run --schemes`: {GRAMMAR}")
    p.add_argument("--calibrator", default=None,
                   help="calibrator of the static recipes that name none (minmax, percentile, ...)")
    p.add_argument("--calib-text", default=None, action=TextFiles,
                   help="calibration text file; several: repeat or comma-separate (default: shipped sample, Austen)")
    p.add_argument("--eval-text", default=None, action=TextFiles,
                   help="evaluation text file; several: repeat or comma-separate (default: shipped sample, Melville)")
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument("--batch-size", type=positive_int, default=4)
    p.add_argument("--max-calib-tokens", type=positive_int, default=4096)
    p.add_argument("--max-eval-tokens", type=positive_int, default=4096)
    p.add_argument("--calib-captured", default=None, help="captured inputs (folder of <label>.npy) instead of running the model")
    p.add_argument("--eval-captured", default=None, help="with --calib-captured: per-layer numbers only, no transformers needed")
    p.add_argument("--no-ablation", action="store_true", help="skip the per-layer end-to-end runs (one model run per layer)")
    add_device_argument(p)
    p.add_argument("--out", default="reports", help="report folder (default reports/); writes model-<name>.json and .md")
    p.set_defaults(_action=_eval)

    p = sub.add_parser("adequacy", help="does the calibration set suffice: range convergence over bootstrap resamples "
                                        "of its sequences, held-out clipping, domain shift (needs transformers)")
    p.add_argument("path", nargs="?", default=None, help="model folder (or --model)")
    p.add_argument("--model", default=None, metavar="DIR", help="model folder (config.json + safetensors)")
    add_target_argument(p)
    p.add_argument("--layers", default="all", help="layers: all, a range 0-3, a list 0,5,7 (default all)")
    p.add_argument("--text", default=None, action=TextFiles,
                   help="calibration text; several: repeat or comma-separate (default: shipped sample, Austen)")
    p.add_argument("--eval-text", default=None, action=TextFiles,
                   help="held-out text; several: repeat or comma-separate (default: shipped sample, Melville)")
    p.add_argument("--shift-text", default="code", metavar="FILE|code",
                   help="text of another domain, or 'code' (the shipped Python sample, default), or 'none'")
    p.add_argument("--scheme", default="w8a8", help="a scheme with static activation ranges (default w8a8)")
    p.add_argument("--calibrator", default="mse", help="minmax, percentile[:P], entropy, mse, auto (default mse)")
    p.add_argument("--bootstrap", type=positive_int, default=50, help="resamples per size (default 50)")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="stable once the range's relative spread (p95-p5 over median) stays under this (default 0.05)")
    p.add_argument("--seed", type=int, default=0, help="resampling seed (default 0)")
    p.add_argument("--seq-len", type=positive_int, default=128, help="tokens per sequence, the resampled unit")
    p.add_argument("--max-calib-tokens", type=positive_int, default=4096)
    p.add_argument("--max-eval-tokens", type=positive_int, default=4096, help="also caps the shift text")
    p.add_argument("--bins", type=positive_int, default=2048, help="histogram bins per site (default 2048)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="read a .bin/.pt checkpoint with torch.load(weights_only=True); only for files you trust")
    p.add_argument("--out", required=True, help="output folder: adequacy.json and adequacy.md")
    p.set_defaults(_action=_adequacy)


def run(args: argparse.Namespace) -> int:
    return int(args._action(args) or 0)


def _inspect(args: argparse.Namespace) -> int:
    info = inspect_model(args.path, allow_pickle=args.allow_pickle)
    wanted = set(parse_layers(args.layers, info.n_layers))
    spec = info.spec
    print(f"model: {info.path}  ({info.model_type}, {info.kind.value}, {info.weights_format}: {', '.join(info.weight_files)})")
    source = ("found from the model: its modules, the activation settled by reproducing the module's output"
              if info.arch.discovered else f"from config {info.hf_activation!r}")
    # the model's own activation module has no ffnquant variant: the FFN's form and the module's class are said
    form = (f"{'gated' if spec.gated else 'dense'} (activation {info.hf_activation}, the model's own module"
            if spec.activation in OWN_ACTIVATIONS else f"{spec.variant.value} (activation {spec.activation.value}")
    print(f"FFN: {form}, {source}), "
          f"d_model {spec.d_model}, d_ff {spec.d_ff}, bias {fmt(spec.bias)}, "
          f"{fmt(spec.n_params)} parameters per FFN")
    for part in info.arch.float_parts:
        print(f"float: {part}")
    if info.kind.value == "causal_lm":
        from ..hf.draft import folder_draft_refusal

        if folder_draft_refusal(info.path) is not None:  # its forward takes its target's states, not token ids
            print("draft model: runs through the model it drafts for; give that target with --target-model on every "
                  "command that runs it")
    experts = f", {info.n_experts} experts each" if info.n_experts else ""
    stored = [l for l in info.layers if l.shares is None]  # a shared FFN's weights are stored (and counted) once
    how = ("each call with its own adapters: each call quantized through its own adapters from every call's "
           "statistics merged, to the same weights" if info.calls_differ() else "quantized once, from every call's "
           "inputs")
    shared = (f" ({len(info.layers) - len(stored)} of them an earlier layer's FFN called again, its weights "
              f"shared: {how})") if len(stored) < len(info.layers) else ""
    print(f"layers: {info.n_layers}{experts}; {len(info.layers)} FFNs{shared}, "
          f"{fmt(spec.n_params * len(stored))} FFN parameters")
    rows = [(l.label, l.stack or "-", l.block, "-" if l.expert is None else l.expert,
             l.name + (f" (L{l.shares}'s, shared)" if l.shares is not None else ""))
            for l in info.layers if l.index in wanted]
    print(text_table(["layer", "stack", "block", "expert", "module"], rows))
    return 0


def _capture(args: argparse.Namespace) -> int:
    from ..hf.capture import iter_captured, load_hf_model, load_tokenizer, model_text_batches, save_captured

    info = inspect_model(args.path, allow_pickle=args.allow_pickle)
    layers = [l.info for l in load_ffn_layers(info, args.layers, allow_pickle=args.allow_pickle)]
    # the .npy files are staged in --out (checked before the model loads) and moved into place together
    # once every layer is written: a failure or Ctrl-C leaves --out as it was
    with OutputTransaction() as tx:
        out = tx.folder(args.out)
        # the text is read and tokenized, its ids checked against config.json, before the model loads
        batches = model_text_batches(info, load_tokenizer(info.path), args.text, "calibration", args.seq_len, 4,
                                     args.max_tokens)
        model = load_hf_model(info, allow_pickle=args.allow_pickle)
        files = save_captured(out, iter_captured(model, info, layers, batches), info.spec.d_model)
        files = {label: tx.final(path) for label, path in files.items()}
    print(text_table(["layer", "file"], [(label, str(path)) for label, path in files.items()]))
    return 0


def _slug(path: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(path).resolve().name).strip("-") or "model"


def _eval(args: argparse.Namespace) -> int:
    schemes = [parse_recipe(s) for s in args.schemes.split(",") if s.strip()]  # each recipe parsed once, here
    if not schemes:
        raise FFNQuantError("--schemes is empty")
    settings = EvalSettings(seq_len=args.seq_len, batch_size=args.batch_size, max_calib_tokens=args.max_calib_tokens,
                            max_eval_tokens=args.max_eval_tokens, ablation=not args.no_ablation)
    if (args.calib_captured is None) != (args.eval_captured is None):
        raise FFNQuantError("--calib-captured and --eval-captured go together")
    # The report is staged in --out (checked here, before the model runs) and moved into place at the
    # end: a failure or Ctrl-C leaves --out as it was.
    with OutputTransaction() as tx:
        out = tx.folder(args.out)
        if args.calib_captured is not None:
            from ..hf.evaluate import evaluate_layers_from_files

            result = evaluate_layers_from_files(args.path, schemes, args.calib_captured, args.eval_captured,
                                                layers=args.layers, calibrator=args.calibrator,
                                                allow_pickle=args.allow_pickle)
        else:
            result = evaluate_model(args.path, schemes, layers=args.layers, calib_text=args.calib_text,
                                    eval_text=args.eval_text, settings=settings, calibrator=args.calibrator,
                                    allow_pickle=args.allow_pickle)
        result["environment"] = environment()
        name = f"model-{_slug(args.path)}"
        json_path = tx.final(write_json(out / f"{name}.json", result))
        md_path = tx.final(write_text(out / f"{name}.md", model_eval_markdown(result)))
    if args.calib_captured is not None:
        rows = [(recipe_name(s), r["label"], r["sqnr_db"], r["cosine"]) for s in result["schemes"] for r in s["layers"]]
        print(text_table(["scheme", "layer", "SQNR dB", "cosine"], rows))
        print(f"wrote {json_path} and {md_path} (per layer only: no model run)")
        return 0
    causal = result["model"]["kind"] == "causal_lm"
    rows = []
    for s in result["schemes"]:
        e = s["end_to_end"]
        own = [r["sqnr_db"] for r in s["layers"] if r["sqnr_db"] is not None]
        rows.append([recipe_name(s)] + ([e["perplexity"], ppl_change(e), agreement_words(e)] if causal else [])
                    + [e["hidden_sqnr_db"], min(own) if own else None, ", ".join(s["worst_layers_end_to_end"] or s["worst_layers_sqnr"])])
    head = ["scheme"] + (["perplexity", "change (95% CI)", "against float"] if causal else []) + [
        "hidden SQNR dB", "min layer SQNR dB", "hurts most"]
    for line in token_notes(result.get("token_budgets", {}).values()):
        print(line)
    if causal:
        print(f"float perplexity {fmt(result['baseline']['perplexity'])} on {result['baseline']['n_tokens']} tokens")
    print(text_table(head, rows))
    for s in result["skipped"]:
        print(f"skipped {s['scheme']}: {s['reason']}")
    print(f"wrote {json_path} and {md_path}")
    return 0


def _adequacy(args: argparse.Namespace) -> int:
    import os
    import shlex

    if (args.path is None) == (args.model is None):
        raise FFNQuantError("give the model folder once: as --model DIR or as the first argument")
    path = args.model or args.path
    shift = None if args.shift_text.strip().lower() == "none" else args.shift_text
    settings = EvalSettings(seq_len=args.seq_len, max_calib_tokens=args.max_calib_tokens,
                            max_eval_tokens=args.max_eval_tokens, bins=args.bins)
    # staged in --out (checked here, before the model runs) and moved into place at the end
    with OutputTransaction() as tx:
        out = tx.folder(args.out)
        result = model_adequacy(path, layers=args.layers, text=args.text, eval_text=args.eval_text, shift_text=shift,
                                calibrator=args.calibrator, scheme=args.scheme, bootstrap=args.bootstrap,
                                seed=args.seed, tolerance=args.tolerance, settings=settings,
                                allow_pickle=args.allow_pickle)
        argv = getattr(args, "_argv", None) or ["model", "adequacy"]
        # paths outside the working folder are shown as folder/name: reports never print this machine's layout
        result["command"] = "ffnquant " + " ".join(shlex.quote(display_path(a) if os.path.isabs(a) else a) for a in argv)
        result["model"]["path"] = display_path(result["model"]["path"])
        result["environment"] = environment()
        json_path = tx.final(write_json(out / "adequacy.json", result))
        md_path = tx.final(write_text(out / "adequacy.md", adequacy_markdown(result)))
    for line in token_notes(b["tokens"] for b in result["texts"].values() if b):
        print(line)
    rows = [(layer["label"], site, a["convergence"]["converged_at"], f"{100 * a['convergence']['final_spread']:.1f}%",
             f"{100 * a['held_out']['clip_rate']:.3f}%", layer["shift_sqnr_delta_db"], a["verdict"])
            for layer in result["layers"] for site, a in layer["sites"].items()]
    print(text_table(["layer", "site", "stable from", "spread", "held-out clip", "shift ΔSQNR dB", "verdict"], rows))
    print(summary_paragraph(result))
    print(f"wall time {result['seconds']['total']:.1f} s")
    print(f"wrote {json_path} and {md_path}")
    return 0
