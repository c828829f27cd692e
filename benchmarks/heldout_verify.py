#!/usr/bin/env python3
"""Plans (and single recipes) re-verified on large held-out texts of several domains, with their uncertainty.

For each plan (or recipe applied to every layer) the FFNs are quantized as the plan says, calibrated on the text
that plan was calibrated on, put back into the model, and scored on every held-out domain against the float model:
perplexity change with its 95% interval (paired per-sequence differences), next-token KL divergence (mean, median,
p99, p99.9, max) and top-1 agreement (ffnquant.hf.metrics). The float model runs once per domain; its figures are
kept (`float_reference`) and every candidate is scored against them, so the time per candidate is one quantized
pass per domain.

The held-out windows skip the first `--skip-tokens` tokens of each domain (what a plan made with that many held-out
tokens verified on), so they are text the plans never saw.

Usage:
  PYTHONPATH=. python benchmarks/heldout_verify.py --model models/smollm2-135m-instruct \
      --plan 'ppl+1% (committed)=reports/trained-llm/plan/plan.toml@ffnquant/data/calibration.txt' \
      --recipe 'w8a8-dynamic-s8 everywhere=w8a8-dynamic-s8@prose:calibration' \
      --domains prose:evaluation,code:evaluation --tokens 50000 --skip-tokens 4096 \
      --out reports/trained-llm/heldout
Writes OUT/heldout.json and OUT/heldout.md (stamped with the machine, versions and the command).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
import time
from pathlib import Path

import torch


def _windows_after(info, tokenizer, source: str, seq_len: int, batch_size: int, skip: int, tokens: int):
    """The domain's batches after its first `skip` tokens, `tokens` of them: ffnquant's document windows in their
    order (what a plan with `skip` held-out tokens verified on is exactly the windows skipped), then batched."""
    from ffnquant.hf.capture import check_token_ids
    from ffnquant.hf.corpus import document_windows, load_documents, window_batches

    windows = document_windows(tokenizer, load_documents(source, "evaluation"), seq_len, max_tokens=skip + tokens)
    seen, kept = 0, []
    for w in windows:
        if seen >= skip:
            kept.append(w)
        seen += len(w)
    batches = window_batches(kept, batch_size)
    check_token_ids(info, batches, source)
    return batches


def _candidate(spec: str, kind: str):
    """'NAME=PATH_OR_RECIPE@CALIBRATION[@TOKENS]' -> (name, what, calibration source, calibration tokens)."""
    name, _, rest = spec.partition("=")
    parts = rest.split("@")
    if kind == "recipe":  # the recipe itself may hold '@CALIBRATOR'
        *recipe, calib = parts[:-1], parts[-1]
        if calib.isdigit():
            raise SystemExit(f"--recipe {spec!r}: give NAME=RECIPE@CALIBRATION_TEXT")
        return name, "@".join(recipe[0]), calib, None
    what, calib = parts[0], parts[1] if len(parts) > 1 else None
    tokens = int(parts[2]) if len(parts) > 2 else None
    return name, what, calib, tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--plan", action="append", default=[], help="NAME=PLAN.toml@CALIBRATION_TEXT[@CALIB_TOKENS]")
    ap.add_argument("--recipe", action="append", default=[], help="NAME=RECIPE@CALIBRATION_TEXT (every layer)")
    ap.add_argument("--folder", action="append", default=[],
                    help="NAME=FOLDER: a model another tool quantized (e.g. llm-compressor's), loaded by transformers")
    ap.add_argument("--domains", default="prose:evaluation,code:evaluation")
    ap.add_argument("--tokens", type=int, default=50_000, help="held-out tokens per domain")
    ap.add_argument("--skip-tokens", type=int, default=4096)
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--out", default="reports/trained-llm/heldout")
    ap.add_argument("--cache", default=None, help="folder keeping the float model's figures between runs")
    args = ap.parse_args(argv)

    from ffnquant.infra.atomic import write_json, write_text
    from ffnquant.infra.envinfo import environment
    from ffnquant.hf import EvalSettings, capture_layer_inputs, inspect_model, load_ffn_layers, quantized_layers
    from ffnquant.hf.capture import load_hf_model, load_tokenizer
    from ffnquant.hf.evaluate import end_to_end, float_reference
    from ffnquant.planning import Plan, load_plan
    from ffnquant.planning.planfile import model_fingerprint
    from ffnquant.recipe import Recipe

    t0 = time.perf_counter()
    info = inspect_model(args.model)
    tokenizer = load_tokenizer(info.path)
    layers = load_ffn_layers(info, "all")
    settings = EvalSettings(seq_len=args.seq_len, batch_size=args.batch_size, max_calib_tokens=args.calib_tokens,
                            max_eval_tokens=512, ablation=False)
    domains = {}
    for source in args.domains.split(","):
        batches = _windows_after(info, tokenizer, source, args.seq_len, args.batch_size, args.skip_tokens, args.tokens)
        domains[source] = batches
        print(f"{source}: {sum(int(b.numel()) for b in batches):,} tokens in {sum(b.shape[0] for b in batches)} "
              f"sequences after the first {args.skip_tokens:,}", flush=True)
    model = load_hf_model(info)
    refs, baselines, timings = {}, {}, {}
    from_cache: list[str] = []
    for source, batches in domains.items():
        t = time.perf_counter()
        # the float model's figures of these exact windows, kept on disk between runs (--cache): a later run with
        # other candidates scores against the same reference without running the float model again
        key = hashlib.sha256(repr((str(info.path.resolve()), source, args.seq_len, args.skip_tokens, args.tokens,
                                   [b.tolist() for b in batches])).encode()).hexdigest()[:16]
        cached = Path(args.cache) / f"float-{key}.pt" if args.cache else None
        if cached is not None and cached.exists():
            baselines[source], refs[source] = torch.load(cached, weights_only=False)
            from_cache.append(source)
        else:
            baselines[source], refs[source] = float_reference(model, info, batches)
            if cached is not None:
                cached.parent.mkdir(parents=True, exist_ok=True)
                torch.save((baselines[source], refs[source]), cached.with_suffix(".tmp"))
                cached.with_suffix(".tmp").replace(cached)
        timings[f"float reference {source}"] = time.perf_counter() - t
        print(f"float {source}: perplexity {baselines[source]['perplexity']:.4f} "
              f"({timings[f'float reference {source}']:.0f} s)", flush=True)

    candidates = [("plan", *_candidate(s, "plan")) for s in args.plan] + \
                 [("recipe", *_candidate(s, "recipe")) for s in args.recipe]
    results = []
    for spec in args.folder:  # another tool's quantized model, loaded by transformers, on the same windows
        name, _, folder = spec.partition("=")
        t = time.perf_counter()
        import transformers

        from ffnquant.hf.metrics import compare_models
        from ffnquant.infra.thirdparty import quiet_model_io

        with quiet_model_io():
            other = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        row = {"name": name, "kind": "folder", "what": folder, "calibration": "its own (see its provenance)",
               "calibration_tokens": 0, "quantize_s": time.perf_counter() - t, "domains": {}}
        for source, batches in domains.items():
            t = time.perf_counter()
            fig = compare_models(None, other, info, batches, references=refs[source])
            fig["score_s"] = time.perf_counter() - t
            row["domains"][source] = fig
            _say(name, source, fig)
        results.append(row)
        del other
    for kind, name, what, calib, calib_tokens in candidates:
        t = time.perf_counter()
        if kind == "plan":
            recipe = load_plan(what, info)
        else:
            r = Recipe.parse(what)
            recipe = Plan(model_fingerprint(info), {layer.index: r for layer in layers})
        inputs = capture_layer_inputs(info, layers, text=calib, eval_text="code:evaluation",
                                      calib_tokens=calib_tokens or args.calib_tokens, eval_tokens=512,
                                      settings=settings)
        _, qffns = quantized_layers(info, layers, inputs, recipe, onnx=False, sensitivity=False)
        t_quant = time.perf_counter() - t
        row = {"name": name, "kind": kind, "what": what, "calibration": inputs.calibration_source,
               "calibration_tokens": inputs.budgets["calibration"]["obtained"], "quantize_s": t_quant, "domains": {}}
        for source, batches in domains.items():
            t = time.perf_counter()
            fig = end_to_end(model, info, layers, qffns, batches, settings, baselines[source],
                             references=refs[source])["end_to_end"]
            fig["score_s"] = time.perf_counter() - t
            row["domains"][source] = fig
            _say(name, source, fig)
        results.append(row)
        del qffns, inputs

    doc = {"command": "PYTHONPATH=. python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]),
           "model": str(info.path), "environment": environment(), "seq_len": args.seq_len,
           "skip_tokens": args.skip_tokens,
           "domains": {s: {"tokens": sum(int(b.numel()) for b in bs), "sequences": sum(b.shape[0] for b in bs),
                           "float_perplexity": baselines[s]["perplexity"], "float_from_cache": s in from_cache}
                for s, bs in domains.items()},
           "results": results, "timings": timings, "total_s": time.perf_counter() - t0}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "heldout.json", doc)
    write_text(out / "heldout.md", render(doc))
    print(f"wrote {out / 'heldout.md'}")
    return 0


def _say(name, source, fig) -> None:
    lo, hi = fig.get("perplexity_ratio_ci") or (float("nan"), float("nan"))
    print(f"{name} on {source}: {100 * (fig['perplexity_ratio'] - 1):+.2f}% (95% CI {100 * (lo - 1):+.2f}.."
          f"{100 * (hi - 1):+.2f}%), KL mean {fig['kl']['mean']:.4g} p99 {fig['kl']['p99']:.4g}, top-1 "
          f"{100 * fig['top1_agreement']:.2f}% ({fig['score_s']:.0f} s)", flush=True)


def _pct(x):
    return "-" if x is None else f"{100 * (x - 1):+.2f}%"


def render(doc) -> str:
    env = doc["environment"]
    lines = [f"# Held-out verification on {', '.join(doc['domains'])}", "",
             f"Command: `{doc['command']}`", "",
             f"Machine: {env.get('cpu', '-')}, {env.get('cpu_count', '-')} cores, torch threads "
             f"{env.get('torch_threads', '-')}; torch {env.get('packages', {}).get('torch', '-')}, transformers "
             f"{env.get('packages', {}).get('transformers', '-')}; {env.get('timestamp_utc', '')}; total "
             f"{doc['total_s']:.0f} s.", "",
             "Every figure is against the float model on the same windows: ffnquant's document windows of "
             f"{doc['seq_len']} tokens after the first {doc['skip_tokens']:,} tokens of each domain (what `ffnquant plan` "
             "verifies on by default, so text no plan saw). The interval is 95%, from paired per-sequence "
             "differences; KL is over the float model's top-128 tokens plus one bucket for the rest (a lower bound of "
             "the full KL)." + ("".join(f" The float reference of {s} was read from the --cache of an earlier run of the "
                                        "same windows." for s, d in doc["domains"].items() if d.get("float_from_cache"))), "",
             "| domain | tokens | sequences | float perplexity |", "|---|---|---|---|"]
    for s, d in doc["domains"].items():
        lines.append(f"| {s} | {d['tokens']:,} | {d['sequences']} | {d['float_perplexity']:.4f} |")
    lines += ["", "| candidate | calibrated on | domain | perplexity change (95% CI) | KL mean | KL median | KL p99 | "
              "KL p99.9 | KL max | top-1 agreement | scoring s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        for s, f in r["domains"].items():
            lo, hi = f.get("perplexity_ratio_ci") or (None, None)
            kl = f["kl"]
            lines.append(f"| {r['name']} | {r['calibration']} ({r['calibration_tokens']:,} tokens) | {s} | "
                         f"{_pct(f['perplexity_ratio'])} ({_pct(lo)}..{_pct(hi)}) | {kl['mean']:.4g} | "
                         f"{kl['median']:.4g} | {kl['p99']:.4g} | {kl['p99_9']:.4g} | {kl['max']:.4g} | "
                         f"{100 * f['top1_agreement']:.2f}% | {f['score_s']:.0f} |")
    lines.append("")
    lines += ["Timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in doc["timings"].items()), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
