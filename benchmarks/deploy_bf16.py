"""A bf16 checkpoint deployed both ways, side by side in one run: sizes, the loaded models' figures, generation
equality and CPU decode speed with a KV cache.

    PYTHONPATH=. python benchmarks/deploy_bf16.py [--model models/smollm2-135m-instruct-bf16]
        [--plan reports/trained-llm/plan-bf16/plan.toml] [--out reports/trained-llm/deploy-bf16/side-by-side]

In this run, on the bf16 checkpoint and its plan:
1. `ffnquant export --format compressed-tensors` (computed in bf16, the checkpoint's dtype: the folder is proven
   against ffnquant's bf16 reference, loaded back by transformers in bf16);
2. `ffnquant export --format onnx` (the cached decoder graphs, computed in float32: onnxruntime's CPU kernels);
3. onnxruntime-genai's model builder int4 output of the same checkpoint, where it installs;
4. decode latency per token on the CPU, every model timed in the same interleaved rounds: transformers with the
   source in bf16 and with the compressed-tensors folder in bf16 (one new token on a cached past), and the three
   ONNX graphs on onnxruntime's CPU provider (one thread each; torch on one thread too).
Figures 1-2 are the exports' own documents (`ffnquant-deploy.json`), written in this run and kept in `--out`'s
`ct/` and `onnx/`; the folders themselves go to a temporary directory and are removed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_onnx_genai import _empty, _feed, _genai_int4, _presents  # noqa: E402

COMMAND = "PYTHONPATH=. python benchmarks/deploy_bf16.py"


def _export(model: str, plan: str, fmt: str, out: Path, extra: list[str]) -> dict:
    from ffnquant.cli import main as ffnquant

    argv = ["export", "--model", model, "--plan", plan, "--format", fmt, "--out", str(out), "--no-progress", *extra]
    t0 = time.perf_counter()
    rc = ffnquant(argv)
    doc = json.loads((out / "ffnquant-deploy.json").read_text())
    return {"command": "ffnquant " + " ".join(argv[:8] + ["OUT"] + argv[9:]), "exit_code": rc,
            "seconds": time.perf_counter() - t0, "doc": doc}


def _keep_documents(folder: Path, tmp: Path, dest: Path) -> None:
    """The export's own documents (ffnquant-deploy.json/.md) copied to `dest`, its temporary folder named OUT."""
    from ffnquant.infra.atomic import write_text

    dest.mkdir(parents=True, exist_ok=True)
    for name in ("ffnquant-deploy.json", "ffnquant-deploy.md"):
        write_text(dest / name, _scrub((folder / name).read_text().replace(str(folder), "OUT"), tmp))


def _scrub(text: str, tmp: Path) -> str:
    """`text` with every path under the run's temporary folder reduced to TMP/<file name>."""
    import re

    return re.sub(re.escape(str(tmp)) + r"[^\"\s]*/", "TMP/", text)


def _torch_steps(folder: Path, ids: np.ndarray, contexts: list[int]):
    """{context: one decode step} of transformers' model in `folder` loaded in bf16: each call runs one new
    token on the cached past of context - 1 tokens, then crops the cache back to that past (transformers 5's
    `cache` argument and `crop(-k)`)."""
    import torch
    import transformers as T

    T.logging.set_verbosity_error()
    model = T.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    tokens = torch.from_numpy(ids)
    steps = {}
    for n in contexts:
        with torch.no_grad():
            cache = model(tokens[:, :n - 1], use_cache=True).past_key_values
        step_ids = tokens[:, n - 1:n]

        def step(cache=cache, step_ids=step_ids, n=n):
            with torch.no_grad():
                model(step_ids, cache=cache, use_cache=True, position_ids=torch.tensor([[n - 1]]))
            cache.crop(-1)  # the new token's keys and values dropped: the next call decodes on the same past
        steps[n] = step
    return model, steps


def _onnx_steps(path: Path, shapes: dict, ids: np.ndarray, contexts: list[int]):
    from ffnquant.onnx.onnxquant import ort_session

    s = ort_session(path, threads=1)
    empty = _empty(s, shapes)
    steps = {}
    for n in contexts:
        past = _presents(s, s.run(None, _feed(s, ids[:, :n - 1], empty, 0)))
        feed = _feed(s, ids[:, n - 1:n], past, n - 1)
        steps[n] = lambda s=s, feed=feed: s.run(None, feed)
    return s, steps


def measure(steps: dict, rounds: int, per_round: int) -> dict:
    """p10/p50/p90 ms of each (model, context) step, all timed in the same interleaved rounds."""
    from ffnquant.measure.latency import latency_stats

    times = {k: [] for k in steps}
    for fn in steps.values():  # warm-up: allocation and kernel choice
        fn()
    for _ in range(rounds):
        for key, fn in steps.items():
            for _ in range(per_round):
                t0 = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - t0)
    out: dict = {}
    for (name, n), ts in times.items():
        st = latency_stats(ts)
        out.setdefault(name, {})[str(n)] = {"p10_ms": st.p10_s * 1e3, "p50_ms": st.median_s * 1e3,
                                            "p90_ms": st.p90_s * 1e3, "samples": st.n}
    return out


def _bytes(paths) -> int:
    return sum(p.stat().st_size for p in paths)


def _markdown(doc: dict) -> str:
    from ffnquant.infra.render import fmt, markdown_table

    ct, ox = doc["compressed_tensors"], doc["onnx"]
    proof, load = ct["proof"], ct["proof"]["load"]
    gen = proof.get("generation") or {}
    graph = ox.get("graph") or {}
    dec = graph.get("decoder") or {}
    score = graph.get("score") or {}
    env = doc["environment"]
    pk = env.get("packages", {})
    src = doc["bytes"]["source (bf16 safetensors)"]
    size_rows = [(k, f"{v / 2**20:.1f}", f"{src / v:.2f}x") for k, v in doc["bytes"].items()]
    lat = doc["latency"]
    ctx = [str(c) for c in doc["contexts"]]
    base = "transformers bf16 (source)"
    rows = []
    for name, by in lat.items():
        cells = []
        for c in ctx:
            r = by[c]
            cells += [f"{r['p50_ms']:.2f} ({r['p10_ms']:.2f}-{r['p90_ms']:.2f})", f"{1e3 / r['p50_ms']:.1f}",
                      f"{lat[base][c]['p50_ms'] / r['p50_ms']:.2f}x"]
        rows.append((name, *cells))
    heads = ["model"] + [h for c in ctx for h in (f"decode @{c} ms/token", f"tok/s @{c}", f"vs bf16 source @{c}")]
    lines = [f"# {doc['model']} (bf16) deployed two ways, side by side", "",
             f"Command: `{doc['command']}`", "",
             f"Machine: {env.get('cpu')}, {env.get('cpu_count')} logical CPUs; python {env.get('python')}; "
             + ", ".join(f"{k} {pk[k]}" for k in ("torch", "transformers", "compressed-tensors", "onnx", "onnxruntime",
                                                   "onnxruntime-gpu", "onnxruntime-genai") if pk.get(k))
             + f"; no GPU; measured {env.get('timestamp_utc')}; {doc['wall_s']:.0f} s in all.", "",
             f"Plan: `{doc['plan']}` ({doc['plan_summary']}).", "",
             "## Sizes on disk", "", markdown_table(["model", "MiB", "smaller than the bf16 source"], size_rows), "",
             "## The loaded models' figures", "",
             f"- **compressed-tensors, loaded by {load['loaded_with']}** on {load['n_tokens']} held-out tokens: "
             f"perplexity {fmt(load['baseline_perplexity'])} (the bf16 source) -> {fmt(load['perplexity'])} "
             f"({100 * (load['perplexity_ratio'] - 1):+.2f}%), final hidden SQNR {fmt(load['hidden_sqnr_db'])} dB; "
             f"ffnquant's bf16 reference of the plan: {100 * (load['reference_perplexity_ratio'] - 1):+.2f}%, "
             f"{fmt(load['reference_hidden_sqnr_db'])} dB. Proof: {'PROVEN' if proof['proven'] else 'NOT PROVEN'} "
             f"({proof['weights']['bit_identical']}/{proof['weights']['modules']} weights and "
             f"{proof['layers']['bit_identical']}/{proof['layers']['layers']} layers bit-identical in bf16; every gate "
             f"{'met' if load['gates']['met'] else 'NOT met'}).",
             f"- **ONNX, ffnquant's quantized decoder graph** (float32 arithmetic) on onnxruntime: perplexity "
             f"{fmt((score.get('onnx') or {}).get('perplexity'))} against ffnquant's float32 reference "
             f"{fmt((score.get('reference') or {}).get('perplexity'))} "
             f"({'within' if score.get('meets_tolerance') or score.get('within_resolution') else 'NOT within'} the "
             "reference bound).", "",
             "## Generation equality (greedy, KV cache)", "",
             f"- compressed-tensors folder in transformers (bf16) against ffnquant's bf16 reference of the plan: "
             f"{gen.get('equal')} of {gen.get('prompts')} prompts equal over {gen.get('new_tokens')} new tokens "
             f"({gen.get('tokens_compared')} tokens).",
             f"- ONNX float32 decoder graph against transformers' generate (float32): "
             f"{'equal' if (dec.get('generation') or {}).get('equal') else 'NOT equal'} on "
             f"{(dec.get('generation') or {}).get('prompts')} prompts x {(dec.get('generation') or {}).get('new_tokens')} "
             f"tokens; the quantized graph shares its first {(dec.get('generation') or {}).get('quantized_leading_tokens_equal')} "
             "tokens with it.", "",
             "## Decode speed on this CPU (one thread each, batch 1)", "",
             f"One new token on a cached past of N - 1 tokens; {doc['rounds']} interleaved rounds of {doc['per_round']} "
             "calls per model and context; p50 (p10-p90) ms.", "",
             markdown_table(heads, rows), "",
             "How each was made:", "", *(f"- {k}: {v}" for k, v in doc["notes"].items()), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct-bf16")
    ap.add_argument("--plan", default="reports/trained-llm/plan-bf16/plan.toml")
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--per-round", type=int, default=3)
    ap.add_argument("--out", default="reports/trained-llm/deploy-bf16/side-by-side")
    ap.add_argument("--render", action="store_true", help="only write the markdown again from --out's json")
    args = ap.parse_args(argv)
    import torch

    from ffnquant.infra.atomic import write_json, write_text
    from ffnquant.infra.envinfo import environment
    from ffnquant.planning import load_plan

    out = Path(args.out)
    if args.render:
        write_text(out / "deploy_bf16.md", _markdown(json.loads((out / "deploy_bf16.json").read_text())))
        return 0
    torch.set_num_threads(1)  # as onnxruntime's one intra-op thread: the same resources for every model
    contexts = [int(c) for c in args.contexts.split(",")]
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.0f} s] {msg}", file=sys.stderr, flush=True)

    plan = load_plan(args.plan)
    model = Path(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        log("export compressed-tensors")
        ct = _export(args.model, args.plan, "compressed-tensors", tmp / "ct", [])
        log("export onnx")
        ox = _export(args.model, args.plan, "onnx", tmp / "onnx", [])
        log("onnxruntime-genai builder")
        genai, genai_how = _genai_int4(model, tmp / "genai")
        notes = {"transformers bf16 (source)": f"{model} loaded with dtype=bfloat16",
                 "transformers bf16 (ffnquant compressed-tensors)": f"`{ct['command']}`, loaded with dtype=bfloat16 "
                                                                    "(transformers decompresses the weights at load and "
                                                                    "fake-quantizes quantized inputs on every call)",
                 "onnx fp32 (ffnquant)": f"`{ox['command']}`: model.fp32.onnx",
                 "onnx plan (ffnquant)": "the same export's model.onnx",
                 "onnxruntime-genai int4": genai_how + " (also int4 attention projections and LM head)"}
        sizes = {"source (bf16 safetensors)": _bytes(model.glob("*.safetensors")),
                 "compressed-tensors folder (ffnquant)": _bytes((tmp / "ct").glob("*.safetensors")),
                 "onnx fp32 graph (ffnquant)": (tmp / "onnx" / "model.fp32.onnx").stat().st_size,
                 "onnx plan graph (ffnquant)": (tmp / "onnx" / "model.onnx").stat().st_size}
        if genai is not None:
            sizes["onnxruntime-genai int4"] = _bytes(genai.parent.glob("model.onnx*"))
        log("decode timing")
        rng = np.random.default_rng(0)
        vocab = int(json.loads((model / "config.json").read_text()).get("vocab_size") or 1000)
        ids = rng.integers(3, min(1000, vocab), (1, max(contexts)), dtype=np.int64)
        steps = {}
        kept = []  # the models stay alive while their steps are timed
        for name, folder in (("transformers bf16 (source)", model),
                             ("transformers bf16 (ffnquant compressed-tensors)", tmp / "ct")):
            m, by_n = _torch_steps(folder, ids, contexts)
            kept.append(m)
            steps.update({(name, n): fn for n, fn in by_n.items()})
        from ffnquant.onnx.onnxquant import ort_session

        shapes = {i.name: i.shape for i in ort_session(tmp / "onnx" / "model.fp32.onnx").get_inputs()}
        graphs = {"onnx fp32 (ffnquant)": tmp / "onnx" / "model.fp32.onnx", "onnx plan (ffnquant)": tmp / "onnx" / "model.onnx"}
        if genai is not None:
            graphs["onnxruntime-genai int4"] = genai
        for name, path in graphs.items():
            try:
                s, by_n = _onnx_steps(path, shapes, ids, contexts)
            except Exception as exc:  # the builder's graph on a model its kernels do not take (said, not timed)
                if name != "onnxruntime-genai int4":
                    raise
                notes[name] += f"; NOT timed: onnxruntime cannot run it here ({str(exc).splitlines()[0][:160]})"
                continue
            kept.append(s)
            steps.update({(name, n): fn for n, fn in by_n.items()})
        latency = measure(steps, args.rounds, args.per_round)
        for name in ("ct", "onnx"):  # each export's own document beside this report
            _keep_documents(tmp / name, tmp, out / name)
    doc = {"command": f"{COMMAND} {' '.join(argv if argv is not None else sys.argv[1:])}".strip(),
           "model": model.name, "plan": args.plan,
           "plan_summary": ", ".join(f"{k} {v}" for k, v in plan.summary.items()
                                     if k in ("verified_in", "measured_perplexity_ratio", "verified")),
           "compressed_tensors": {"command": ct["command"], "exit_code": ct["exit_code"], "seconds": ct["seconds"],
                                  "proof": ct["doc"]["proof"], "written": ct["doc"]["written"],
                                  "reference": ct["doc"]["reference"], "baseline": ct["doc"]["baseline"]},
           "onnx": {"command": ox["command"], "exit_code": ox["exit_code"], "seconds": ox["seconds"],
                    "graph": ox["doc"].get("graph"), "reference": ox["doc"]["reference"]},
           "bytes": sizes, "notes": notes, "contexts": contexts, "rounds": args.rounds, "per_round": args.per_round,
           "latency": latency, "environment": environment(), "wall_s": time.perf_counter() - t_start}
    out.mkdir(parents=True, exist_ok=True)
    doc = json.loads(_scrub(json.dumps(doc), tmp))
    write_json(out / "deploy_bf16.json", doc)
    write_text(out / "deploy_bf16.md", _markdown(doc))
    print(_markdown(doc))
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
