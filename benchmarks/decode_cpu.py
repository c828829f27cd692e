"""CPU decode and prefill latency of ffnquant's cached decoder graphs, side by side in one run on onnxruntime's CPU
provider: the fp32 graph, the fp32 graph as exported before issue 24 item 4 (decomposed attention: kv heads
repeated and K transposed per step), ffnquant's quantized graphs (every FFN layer under one recipe: w8a16,
w4a16-g64, w8a8-dynamic-s8 by default) and onnxruntime-genai's model builder int4 output where it installs.

    PYTHONPATH=. python benchmarks/decode_cpu.py [--model DIR] [--out reports/decode-cpu]

Default model: models/smollm2-135m-instruct when present, else a random-weight Llama of SmolLM2's shape (d_model 576,
d_ff 1536, 30 layers, 9 query / 3 kv heads, vocab 49152; latency does not depend on the weights' values). Each
graph decodes one token on its own past of N - 1 tokens (its own prefill of the same tokens), batch 1, for each
context N; the prefill is one call on `--prefill` tokens from an empty cache. Every graph and size runs in every
round (interleaved), so the machine's drift hits all alike; p50 with p10-p90. Also per graph: how many elements of
a decode step's tensors have a total-length dim (onnxruntime's profiler), against the presents' own.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_onnx_genai import _empty, _feed, _genai_int4, _presents  # noqa: E402

COMMAND = "PYTHONPATH=. python benchmarks/decode_cpu.py"
TRAINED = Path("models/smollm2-135m-instruct")


def _random_llama(folder: Path) -> Path:
    """A random Llama of SmolLM2-135M's shape, written with transformers (the tests' word-level tokenizer)."""
    import torch
    import transformers as T

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from hf_models import tokenizer

    T.logging.set_verbosity_error()
    config = T.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                           tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    T.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tokenizer(T).save_pretrained(folder)
    return folder


def _graphs(model: Path, recipes: list[str], out: Path, before: bool, log) -> tuple[dict, dict]:
    """{label: path} of ffnquant's graphs and {label: how it was written}."""
    from ffnquant.deploy import build_planned_model
    from ffnquant.deploy.onnx_decoder import export_decoder
    from ffnquant.deploy.onnx_rewrite import quantize_graph
    from ffnquant.onnx.export import DEFAULT_OPSET
    from ffnquant.hf import inspect_model
    from ffnquant.planning.planfile import Plan, model_fingerprint
    from ffnquant.recipe import Recipe

    info = inspect_model(model)
    paths, notes = {}, {}
    for n, recipe in enumerate(recipes):
        plan = Plan(model_fingerprint(info), {layer.index: Recipe.parse(recipe) for layer in info.layers}, None, None)
        t = time.perf_counter()
        planned = build_planned_model(info, plan, calib_tokens=512, eval_tokens=256)
        if n == 0:
            paths["ffnquant fp32"] = out / "fp32.onnx"
            parity = export_decoder(planned.float_model, info, paths["ffnquant fp32"], DEFAULT_OPSET)
            notes["ffnquant fp32"] = f"{parity['attention']}, opset {parity['opset']}"
            if before:  # the export as it was: decomposed SDPA at the default opset, kv heads repeated
                from ffnquant.deploy.onnx_decoder import _export_decoder

                paths["ffnquant fp32 (before)"] = out / "fp32-before.onnx"
                _export_decoder(planned.float_model, info, paths["ffnquant fp32 (before)"], DEFAULT_OPSET, None)
                notes["ffnquant fp32 (before)"] = f"decomposed SDPA, opset {DEFAULT_OPSET} (the export before this change)"
        tmp = out / f"{recipe}.fp32.onnx"
        export_decoder(planned.model, info, tmp, DEFAULT_OPSET)
        label = f"ffnquant {recipe}"
        paths[label] = out / f"{recipe}.onnx"
        written = quantize_graph(tmp, planned, paths[label])
        tmp.unlink()
        notes[label] = "FFN matmuls: " + ", ".join(f"{k} {v}" for k, v in sorted(written["kinds"].items()))
        log(f"{label}: written in {time.perf_counter() - t:.0f} s")
        del planned
    return paths, notes


def _step_growth(path: Path, past: int, folder: Path) -> dict:
    from ffnquant.deploy.onnx_decoder import decode_step_tensors

    total = past + 1
    ran = decode_step_tensors(path, past, folder)
    grown = [s for r in ran for s in r["shapes"] if total in s]
    presents = [s for r in ran if r["op"] == "Concat" for s in r["shapes"] if total in s]
    return {"nodes": len(ran), "attention_nodes": sum(r["op"] in ("Attention", "GroupQueryAttention") for r in ran),
            "total_length_elements": sum(math.prod(s) for s in grown),
            "largest": max((math.prod(s) for s in grown), default=0),
            "total_by_total": sum(s.count(total) > 1 for s in grown), "concat_elements": sum(math.prod(s) for s in presents)}


def measure(paths: dict, contexts: list[int], prefill: int, rounds: int, per_round: int, threads: int | None) -> dict:
    from ffnquant.measure.latency import latency_stats
    from ffnquant.onnx.onnxquant import ort_session

    sessions = {k: ort_session(p, threads=threads) for k, p in paths.items()}
    shapes = {i.name: i.shape for i in sessions["ffnquant fp32"].get_inputs()}
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 1000, (1, max(contexts + [prefill])), dtype=np.int64)
    feeds = {}
    for key, s in sessions.items():
        empty = _empty(s, shapes)
        feeds[key, "prefill"] = _feed(s, ids[:, :prefill], empty, 0)
        for n in contexts:
            past = _presents(s, s.run(None, _feed(s, ids[:, :n - 1], empty, 0)))
            feeds[key, n] = _feed(s, ids[:, n - 1:n], past, n - 1)
    sizes = [*contexts, "prefill"]
    times = {k: [] for k in feeds}
    for k, f in feeds.items():  # warm-up: allocation and kernel choice
        sessions[k[0]].run(None, f)
    for _ in range(rounds):
        for n in sizes:
            for key, s in sessions.items():
                for _ in range(1 if n == "prefill" else per_round):
                    t0 = time.perf_counter()
                    s.run(None, feeds[key, n])
                    times[key, n].append(time.perf_counter() - t0)
    out = {}
    for n in sizes:
        out[str(n)] = {}
        for key in sessions:
            st = latency_stats(times[key, n])
            out[str(n)][key] = {"p10_ms": st.p10_s * 1e3, "p50_ms": st.median_s * 1e3, "p90_ms": st.p90_s * 1e3,
                                "samples": st.n}
    return out


def _markdown(doc: dict) -> str:
    from ffnquant.infra.render import markdown_table

    rows = doc["latency"]
    base = "ffnquant fp32"
    ctx = sorted((c for c in rows if c != "prefill"), key=int)

    def cell(key, n):
        r = rows[n][key]
        return f"{r['p50_ms']:.2f} ({r['p10_ms']:.2f}-{r['p90_ms']:.2f})"

    table = [(key, *(cell(key, n) for n in ctx), *(f"{rows[n][base]['p50_ms'] / rows[n][key]['p50_ms']:.2f}x" for n in ctx),
              cell(key, "prefill"), f"{rows['prefill'][base]['p50_ms'] / rows['prefill'][key]['p50_ms']:.2f}x",
              f"{doc['bytes'][key] / 1e6:.0f}") for key in rows[ctx[0]]]
    heads = ["graph", *(f"decode @{n} ms/token" for n in ctx), *(f"vs fp32 @{n}" for n in ctx),
             f"prefill {doc['prefill_tokens']} ms", "vs fp32", "MB"]
    growth = [(k, g["nodes"], g["attention_nodes"], f"{g['total_length_elements']:,}", f"{g['concat_elements']:,}",
               g["total_by_total"]) for k, g in doc["step_structure"].items()]
    env = doc["environment"]
    pk = env.get("packages", {})
    lines = [f"# CPU decode latency with a KV cache: {doc['model']}", "",
             f"Command: `{doc['command']}`", "",
             f"Machine: {env.get('cpu')}, {env.get('cpu_count')} logical CPUs, {env.get('platform')}; python "
             f"{env.get('python')}; " + ", ".join(f"{k} {pk[k]}" for k in ("torch", "transformers", "onnx", "onnxruntime", "onnxruntime-gpu",
                                                                           "onnxruntime-genai") if pk.get(k)) +
             f"; {doc['threads']}; measured {env.get('timestamp_utc')}.", "",
             f"onnxruntime's CPU provider, batch 1. Decode: one new token on the graph's own past of N - 1 tokens; "
             f"prefill: one call on {doc['prefill_tokens']} tokens from an empty cache. {doc['rounds']} interleaved "
             f"rounds ({doc['per_round']} decode calls per round, 1 prefill); p50 (p10-p90) ms.", "",
             markdown_table(heads, table), "",
             "How each graph was written:", "", *(f"- {k}: {v}" for k, v in doc["notes"].items()), "",
             f"## What a decode step computes at {doc['structure_context']} tokens of context", "",
             "Every node onnxruntime ran for one decode step (after its graph optimizations), from its profiler: "
             "the elements of all tensors with a total-length dim, beside those of the Concats that write the "
             "presents (the cache the next step reads; the least a step that returns its cache must write).", "",
             markdown_table(["graph", "nodes run", "attention nodes", "total-length elements", "of which presents",
                             "[total, total] tensors"], growth), ""]
    return "\n".join(lines + _findings(doc))


def _findings(doc: dict) -> list[str]:
    """What the table says, computed from it: the growth with the context, and each graph against fp32 at decode."""
    rows = doc["latency"]
    ctx = sorted((c for c in rows if c != "prefill"), key=int)
    lo, hi = ctx[0], ctx[-1]
    out = ["## Reading", ""]
    for key in rows[lo]:
        a, b = rows[lo][key]["p50_ms"], rows[hi][key]["p50_ms"]
        out.append(f"- {key}: {b - a:+.2f} ms per token from {lo} to {hi} tokens of context ({b / a:.2f}x).")
    fp = {n: rows[n]["ffnquant fp32"]["p50_ms"] for n in rows}
    for key in rows[lo]:
        if not key.startswith("ffnquant ") or "fp32" in key:
            continue
        verdict = " and ".join(f"{'faster' if rows[n][key]['p50_ms'] < fp[n] else 'SLOWER'} than fp32 at {n} "
                               f"({rows[n][key]['p50_ms']:.1f} against {fp[n]:.1f} ms)" for n in ctx)
        out.append(f"- {key} decodes {verdict}; prefill {rows['prefill'][key]['p50_ms']:.0f} against "
                   f"{fp['prefill']:.0f} ms.")
    return out + [""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help=f"a local causal LM folder, or `random` (default {TRAINED} when "
                                                  "present, else a random Llama of its shape)")
    ap.add_argument("--recipes", default="w8a16,w4a16-g64,w8a8-dynamic-s8", help="ffnquant recipes, one graph each")
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--prefill", type=int, default=512, help="prefill tokens (default 512)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--per-round", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (default 1; 0: its default)")
    ap.add_argument("--no-before", action="store_true", help="leave out the fp32 graph as exported before")
    ap.add_argument("--no-genai", action="store_true", help="leave out onnxruntime-genai's builder")
    ap.add_argument("--out", default="reports/decode-cpu")
    ap.add_argument("--render", action="store_true", help="only write decode.md again from --out's decode.json")
    args = ap.parse_args(argv)
    from ffnquant.infra.atomic import write_json, write_text
    from ffnquant.infra.envinfo import environment

    if args.render:
        import json

        write_text(Path(args.out) / "decode.md", _markdown(json.loads((Path(args.out) / "decode.json").read_text())))
        return 0

    contexts = [int(c) for c in args.contexts.split(",")]
    recipes = [r for r in args.recipes.split(",") if r]
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.0f} s] {msg}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.model and args.model != "random":
            model, name = Path(args.model), Path(args.model).name
        elif TRAINED.exists() and args.model != "random":
            model, name = TRAINED, f"{TRAINED.name} (trained)"
        else:
            model, name = _random_llama(tmp / "model"), "random Llama of SmolLM2-135M's shape"
        (tmp / "graphs").mkdir()
        paths, notes = _graphs(model, recipes, tmp / "graphs", not args.no_before, log)
        genai_how = "left out (--no-genai)"
        if not args.no_genai:
            genai, genai_how = _genai_int4(model, tmp / "genai")
            log(f"onnxruntime-genai: {genai_how}")
            if genai is not None:
                paths["onnxruntime-genai int4"] = genai
                notes["onnxruntime-genai int4"] = genai_how + " (also int4 attention projections and LM head)"
        sizes = {k: p.stat().st_size + sum(f.stat().st_size for f in p.parent.glob(p.name + ".data"))
                 for k, p in paths.items()}
        structure = {k: _step_growth(p, contexts[-1] - 1, tmp) for k, p in paths.items() if k.startswith("ffnquant")}
        log("timing")
        rows = measure(paths, contexts, args.prefill, args.rounds, args.per_round, args.threads or None)
    doc = {"command": f"{COMMAND} {' '.join(argv if argv is not None else sys.argv[1:])}".strip(), "model": name,
           "recipes": recipes, "genai": genai_how, "notes": notes, "bytes": sizes, "latency": rows,
           "prefill_tokens": args.prefill, "rounds": args.rounds, "per_round": args.per_round,
           "threads": f"{args.threads} onnxruntime intra-op thread(s)" if args.threads else "onnxruntime's default threads",
           "structure_context": contexts[-1], "step_structure": structure, "environment": environment(),
           "wall_s": time.perf_counter() - t_start}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "decode.json", doc)
    write_text(out / "decode.md", _markdown(doc))
    print(_markdown(doc))
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
