"""Per layer of a trained model: onnxruntime's best of its own quantizers against ffnquant's int8 recipes.

    PYTHONPATH=. python benchmarks/ort_baselines.py [--model models/smollm2-135m-instruct] [--layers all]
        [--calib-tokens 4096] [--eval-tokens 4096] [--out reports/trained-llm]

Each FFN's inputs are captured from the model run on the shipped calibration text and, held out, on the
evaluation text (a different book), as `ffnquant model eval` does (`hf.capture_layer_inputs`). Per layer,
`ortbaseline.compare_with_ort` quantizes the fp32 FFN with onnxruntime's quantize_static (MinMax / Percentile
/ Entropy) and quantize_dynamic, runs each on the CPU provider, and sets ffnquant's recipes (torch reference
numerics) against the best of them, all on the same calibration and held-out inputs. quantize_dynamic's
activation range is per session.run: the held-out inputs are run `--run-tokens` at a time (default one model
forward: batch size x sequence length). Writes ort_baselines.{json,md} in --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from ffnquant.infra.atomic import write_json, write_text
from ffnquant.infra.envinfo import environment
from ffnquant.hf.checkpoint import inspect_model, load_ffn_layers
from ffnquant.hf.inputs import EvalSettings, capture_layer_inputs
from ffnquant.onnx.ortbaseline import ORT_METHODS, compare_with_ort
from ffnquant.quantization import prepare
from ffnquant.infra.render import fmt_db, markdown_table

RECIPES = ("w8a8@search", "w8a8@search+smooth", "w8a8@search+smooth+rotate", "w8a8-dynamic-s8")


def _summary(layers: list[dict]) -> dict:
    """Per recipe: in how many layers it matches or beats onnxruntime's best, and its margin's spread."""
    out = {"layers": len(layers), "ort_best_method_counts": {}, "recipes": {}}
    for row in layers:
        best = row["ort"]["best"]["method"] if row["ort"]["best"] else None
        out["ort_best_method_counts"][str(best)] = out["ort_best_method_counts"].get(str(best), 0) + 1
    for recipe in RECIPES:
        margins = [row["recipes"][recipe]["margin_db"] for row in layers if row["recipes"][recipe]["margin_db"] is not None]
        wins = sum(1 for row in layers if row["recipes"][recipe]["matches_or_beats"])
        out["recipes"][recipe] = {
            "matches_or_beats": wins, "of": len(margins),
            "margin_db_min": min(margins) if margins else None,
            "margin_db_median": statistics.median(margins) if margins else None,
            "margin_db_max": max(margins) if margins else None,
            "losing_layers": [row["label"] for row in layers if row["recipes"][recipe]["matches_or_beats"] is False],
        }
    return out


def _markdown(data: dict) -> str:
    methods, s = data["methods"], data["summary"]
    env = data["environment"]
    head = ["layer", *[f"ORT {m}" for m in methods], "ORT best", *RECIPES]
    rows = []
    for row in data["layers"]:
        ort = row["ort"]
        cells = [row["label"]]
        cells += [fmt_db(ort["methods"][m]["sqnr_db"]) if ort["methods"][m]["ok"] else "failed" for m in methods]
        cells.append(f"{ort['best']['method']} {fmt_db(ort['best']['sqnr_db'])}" if ort["best"] else "-")
        for recipe in RECIPES:
            r = row["recipes"][recipe]
            mark = "" if r["matches_or_beats"] is None else (" >=" if r["matches_or_beats"] else " <")
            cells.append(f"{fmt_db(r['sqnr_db'])} ({r['margin_db']:+.2f}){mark}" if r["margin_db"] is not None
                         else fmt_db(r["sqnr_db"]))
        rows.append(cells)
    failures = [f"- {row['label']} {m}: {row['ort']['methods'][m]['error']}" for row in data["layers"] for m in methods
                if not row["ort"]["methods"][m]["ok"]]
    secs = data["seconds"]
    summary_rows = [[r, f"{v['matches_or_beats']} of {v['of']}", fmt_db(v["margin_db_min"]), fmt_db(v["margin_db_median"]),
                     fmt_db(v["margin_db_max"]), ", ".join(v["losing_layers"]) or "-"]
                    for r, v in ((r, s["recipes"][r]) for r in RECIPES if r in s["recipes"])]
    ort_secs = ", ".join(f"{m} {secs['ort_methods'][m]:.1f} s" for m in methods)
    lines = [
        f"# onnxruntime's best of its own quantizers vs ffnquant's int8 recipes, per layer ({data['model']['name']})",
        "",
        f"Command: `{data['command']}`",
        "",
        f"Model `{data['model']['path']}` ({data['model']['model_type']}, {s['layers']} FFN layers, d_model "
        f"{data['model']['d_model']}, d_ff {data['model']['d_ff']}, {data['model']['variant']}). Each layer's FFN inputs "
        f"captured from the model run ({data['settings']['seq_len']}-token windows): {data['tokens']['calibration']} "
        f"calibration tokens from {data['calibration_text']} and {data['tokens']['evaluation']} held-out tokens from "
        f"{data['evaluation_text']}, the same for onnxruntime and ffnquant{_shortfall(data)}. SQNR in dB of the "
        "layer's output against the float FFN on the held-out tokens.",
        "",
        "onnxruntime (" + str(env["packages"].get("onnxruntime-gpu") or env["packages"].get("onnxruntime")) + ", CPU "
        "provider, its QDQ graph quantizes every activation: the matmuls' inputs and outputs, the Sigmoid's and both "
        "Muls'; ffnquant's quantizes the matmuls' inputs): " + "; ".join(
            f"**{m}**: {ORT_METHODS[m]}" for m in methods) + f" (minmax has `onnxquant.ort_default_static`'s settings, "
        "the ORT-default row of the other reports). quantize_dynamic's activation range is per "
        f"session.run: held-out tokens run {data['run_tokens']} at a time (one model forward, batch "
        f"{data['settings']['batch_size']} x {data['settings']['seq_len']}). Percentile and Entropy keep every "
        f"calibration activation in memory{_held(data)} and get the calibration "
        "tokens as one batch; with quantize_static's fixed 128 bins Entropy has a single candidate threshold and "
        "computes MinMax's ranges.",
        "",
        "ffnquant: `quantization.quantize_spec(..., onnx=False)` per recipe, its torch reference numerics (ffnquant's "
        "QDQ artifacts agree with them on onnxruntime within 0.5 dB, `tests/test_onnxquant.py`; `w8a8-dynamic-s8` "
        "(per-token int8 activations) has no ONNX artifact). Each cell: SQNR (margin over ORT's best) and >= when "
        "the recipe matches or beats it.",
        "",
        markdown_table(head, rows),
        "",
        "## Summary (derived from the table above)",
        "",
        markdown_table(["recipe", "layers >= ORT best", "margin min dB", "median", "max", "layers below"], summary_rows),
        "",
        "ORT's best method per layer: " + ", ".join(f"{m} {n}" for m, n in s["ort_best_method_counts"].items()) + ".",
        "",
        _percentile_clips(data),
        "",
        f"Time: {secs['total']:.0f} s in all; capturing the inputs {secs['capture']:.0f} s; onnxruntime's quantize + run "
        f"per method over all layers: {ort_secs}; ffnquant's recipes {secs['ffnquant']:.0f} s (search calibrators "
        f"included); on {env['cpu']} ({env['cpu_count']} cores shared with other jobs, load average "
        f"{data['load_average'][0]:.2f} at the end), torch and the scoring sessions on {data['threads']} thread(s) "
        "(quantize_static's calibration session takes onnxruntime's default).",
        "",
    ]
    lines += ["## onnxruntime failures", "", *(failures or ["None: every method ran on every layer."]), ""]
    return "\n".join(lines)


def _percentile_clips(data: dict) -> str:
    """The layers where Percentile (99.999th percentile of |x|, symmetric) falls more than 3 dB below MinMax."""
    rows = [(r["label"], r["ort"]["methods"]["percentile"]["sqnr_db"], r["ort"]["methods"]["minmax"]["sqnr_db"])
            for r in data["layers"] if {"percentile", "minmax"} <= set(data["methods"])
            and r["ort"]["methods"]["percentile"]["ok"] and r["ort"]["methods"]["minmax"]["ok"]]
    low = [f"{label} ({pct:.1f} vs {mm:.1f} dB)" for label, pct, mm in rows if pct < mm - 3.0]
    return ("Percentile falls more than 3 dB below MinMax (its range ends at the 99.999th percentile of |x|, clipping "
            "the rarest largest activations) in: "
            + (", ".join(low) if low else "no layer") + ".")


def _held(data: dict) -> str:
    """What Percentile/Entropy hold per calibration token (`ortbaseline.ort_quantize`'s estimate for a SwiGLU graph:
    2 d_model-wide and 5 d_ff-wide activations, plus two copies of the widest while histogramming)."""
    m = data["model"]
    if m["variant"] != "swiglu":
        return ""
    return f" (about {(2 * m['d_model'] + 7 * m['d_ff']) * 4 / 1000:.0f} kB per token for this FFN)"


def _shortfall(data: dict) -> str:
    """' (the texts give fewer tokens than the N requested)' when they do."""
    short = [b for b in data["token_budgets"].values() if b.get("short")]
    if not short:
        return ""
    asked = ", ".join(f"{b['requested']:,} {b['split']}" for b in short)
    return f" (the shipped texts give fewer tokens than the {asked} tokens requested)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--layers", default="all")
    p.add_argument("--calib-tokens", type=int, default=4096, help="at most this many (the shipped text gives fewer)")
    p.add_argument("--eval-tokens", type=int, default=4096, help="at most this many (the shipped text gives fewer)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--run-tokens", type=int, default=None, help="tokens per session.run (default batch size x seq len)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="reports/trained-llm")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    run_tokens = args.run_tokens or args.batch_size * args.seq_len
    t_all = time.perf_counter()
    info = inspect_model(args.model)
    layers = load_ffn_layers(info, args.layers if args.layers == "all" else [int(x) for x in args.layers.split(",")])
    settings = EvalSettings(seq_len=args.seq_len, batch_size=args.batch_size, max_calib_tokens=args.calib_tokens,
                            max_eval_tokens=args.eval_tokens, ablation=False)
    t0 = time.perf_counter()
    inputs = capture_layer_inputs(info, layers, calib_tokens=args.calib_tokens, eval_tokens=args.eval_tokens,
                                  settings=settings)
    t_capture = time.perf_counter() - t0
    inputs.model = None  # the transformers model is not needed past the capture
    methods = list(ORT_METHODS)
    rows, t_ort, t_ffn = [], {m: 0.0 for m in methods}, 0.0
    for layer in layers:
        t0 = time.perf_counter()
        prep = prepare(layer.spec, model=layer.ffn, calib_tokens=inputs.calib[layer.label],
                       eval_tokens=inputs.eval[layer.label], name=layer.label)
        out = compare_with_ort(prep, RECIPES, methods=methods, run_tokens=run_tokens, threads=args.threads)
        ort_s = sum(r["seconds"] for r in out["ort"]["methods"].values())
        for m in methods:
            t_ort[m] += out["ort"]["methods"][m]["seconds"]
        t_ffn += time.perf_counter() - t0 - ort_s
        rows.append({"label": layer.label, "index": layer.index, "name": layer.name,
                     "calib_tokens": int(prep.calib.shape[0]), "eval_tokens": int(prep.eval.shape[0]), **out})
        best = out["ort"]["best"]
        print(f"{layer.label}: ORT best {best and best['method']} {best and round(best['sqnr_db'], 2)} dB; "
              + ", ".join(f"{r} {v['sqnr_db']:.2f}" for r, v in out["recipes"].items())
              + f" ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
        del prep
    argv_text = " ".join(argv if argv is not None else sys.argv[1:])
    cmd = f"PYTHONPATH=. python benchmarks/ort_baselines.py {argv_text}".strip()
    calib_counts = sorted({r["calib_tokens"] for r in rows})
    eval_counts = sorted({r["eval_tokens"] for r in rows})
    data = {
        "schema_version": 1,
        "command": cmd,
        "model": {"path": args.model, "name": Path(args.model).name, "model_type": info.model_type,
                  "d_model": info.spec.d_model, "d_ff": info.spec.d_ff, "variant": info.spec.variant.value},
        "settings": settings.to_dict(),
        "calibration_text": inputs.calibration_source,
        "evaluation_text": inputs.evaluation_source,
        "token_budgets": inputs.budgets,
        "tokens": {"calibration": calib_counts[0] if len(calib_counts) == 1 else calib_counts,
                   "evaluation": eval_counts[0] if len(eval_counts) == 1 else eval_counts},
        "run_tokens": run_tokens,
        "threads": args.threads,
        "methods": methods,
        "recipes": list(RECIPES),
        "layers": rows,
        "summary": _summary(rows),
        "seconds": {"total": time.perf_counter() - t_all, "capture": t_capture, "ort_methods": t_ort, "ffnquant": t_ffn},
        "load_average": list(os.getloadavg()),
        "environment": environment(),
    }
    out_dir = Path(args.out)
    write_json(out_dir / "ort_baselines.json", data)
    write_text(out_dir / "ort_baselines.md", _markdown(data))
    print(f"wrote {out_dir / 'ort_baselines.json'} and .md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
