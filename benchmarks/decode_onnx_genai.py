"""Per-token decode latency with a KV cache, side by side in one run on onnxruntime's CPU provider: ffnquant's fp32
decoder graph, ffnquant's planned graph (w4a16-g32 on every FFN by default: MatMulNBits) and onnxruntime-genai's
model builder int4 output of the same model (`python -m onnxruntime_genai.models.builder -p int4 -e cpu`, which also
quantizes attention and the LM head, and fuses attention into GroupQueryAttention).

    PYTHONPATH=. python benchmarks/decode_onnx_genai.py [--model DIR] [--recipe w4a16-g32] [--contexts 128,1024]

Without --model a small random-weight Llama (d 256, 4 layers, 2048 positions) is built in a temporary folder with
the tests' word-level tokenizer: latency does not depend on the weights' values. Each graph decodes one token on
its own past of N - 1 tokens (its own prefill of the same random tokens); interleaved rounds, p10/p50/p90 ms.
Needs onnxruntime-genai (`pip install onnxruntime-genai`: a wheel exists for CPython 3.11 on x86-64 Linux and
requires onnxruntime >= 1.31); without it only ffnquant's two graphs are timed, and the report says so.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

COMMAND = "PYTHONPATH=. python benchmarks/decode_onnx_genai.py"


def _small_llama(folder: Path) -> Path:
    import torch
    import transformers as T

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from hf_models import tokenizer

    T.logging.set_verbosity_error()
    config = T.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    T.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tokenizer(T).save_pretrained(folder)
    return folder


def _ffnquant_graphs(model: Path, recipe: str, out: Path) -> dict:
    from ffnquant.deploy import build_planned_model
    from ffnquant.deploy.onnx_model import write_model_graph
    from ffnquant.hf import inspect_model
    from ffnquant.planning.planfile import Plan, model_fingerprint
    from ffnquant.recipe import Recipe

    info = inspect_model(model)
    plan = Plan(model_fingerprint(info), {layer.index: Recipe.parse(recipe) for layer in info.layers}, None, None)
    planned = build_planned_model(info, plan, calib_tokens=512, eval_tokens=512)
    # the export's own decode figures are left to the side-by-side run below (contexts=())
    return write_model_graph(planned, out, tokens=(1,), rounds=1, contexts=())


def _genai_int4(model: Path, out: Path) -> tuple[Path | None, str]:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError as exc:
        return None, f"onnxruntime-genai is not installed ({exc})"
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", str(model), "-i", str(model), "-o", str(out),
           "-p", "int4", "-e", "cpu", "-c", str(out.parent / "genai-cache")]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0 or not (out / "model.onnx").exists():
        return None, f"the builder failed: {(run.stderr or run.stdout).strip().splitlines()[-1:]}"
    import onnxruntime_genai as og

    return out / "model.onnx", f"onnxruntime-genai {og.__version__} model builder, -p int4 -e cpu"


def _feed(session, ids: np.ndarray, past: dict, start: int) -> dict:
    """The inputs a cached graph takes (the builder's graph has no position_ids: it derives them from the mask)."""
    b, s = ids.shape
    full = {"input_ids": ids, "attention_mask": np.ones((b, start + s), np.int64),
            "position_ids": np.arange(start, start + s, dtype=np.int64)[None].repeat(b, 0), **past}
    names = {i.name for i in session.get_inputs()}
    return {k: v for k, v in full.items() if k in names}


def _empty(session, shapes: dict) -> dict:
    """Empty pasts; `shapes` (ffnquant's graph's, all ints) stands in for dims the builder leaves symbolic."""
    return {i.name: np.zeros((1, *shapes[i.name][1:2], 0, *shapes[i.name][3:]), np.float32)
            for i in session.get_inputs() if i.name.startswith("past_key_values.")}


def _presents(session, outs) -> dict:
    names = [o.name for o in session.get_outputs()]
    return {n.replace("present.", "past_key_values.", 1): v for n, v in zip(names, outs) if n.startswith("present.")}


def side_by_side(paths: dict, contexts, rounds: int, per_round: int, seed: int = 0) -> dict:
    from ffnquant.measure.latency import latency_stats
    from ffnquant.onnx.onnxquant import ort_session

    sessions = {k: ort_session(p) for k, p in paths.items()}
    shapes = {i.name: i.shape for i in next(iter(sessions.values())).get_inputs()}
    rng = np.random.default_rng(seed)
    feeds = {}
    for n in contexts:
        ids = rng.integers(3, 90, (1, n), dtype=np.int64)
        for key, s in sessions.items():
            empty = _empty(s, shapes)
            past = empty if n == 1 else _presents(s, s.run(None, _feed(s, ids[:, :n - 1], empty, 0)))
            feeds[key, n] = _feed(s, ids[:, n - 1:], past, n - 1)
    times = {k: [] for k in feeds}
    for k, f in feeds.items():  # warm-up: allocation and kernel choice
        sessions[k[0]].run(None, f)
    for _ in range(rounds):
        for n in contexts:
            for key, s in sessions.items():
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    s.run(None, feeds[key, n])
                    times[key, n].append(time.perf_counter() - t0)
    out = {}
    for n in contexts:
        row = {}
        for key in sessions:
            st = latency_stats(times[key, n])
            row[key] = {"p10_ms": st.p10_s * 1e3, "p50_ms": st.median_s * 1e3, "p90_ms": st.p90_s * 1e3,
                        "tokens_per_s": 1.0 / st.median_s, "samples": st.n}
        out[str(n)] = row
    return out


def main(argv=None) -> int:
    from ffnquant.infra.render import markdown_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a local causal LM folder (default: a small random Llama)")
    ap.add_argument("--recipe", default="w4a16-g32", help="ffnquant's recipe on every FFN layer (default w4a16-g32)")
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--per-round", type=int, default=5)
    ap.add_argument("--out", default=None, help="write decode.json and decode.md here")
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = Path(args.model) if args.model else _small_llama(tmp / "model")
        graph = _ffnquant_graphs(model, args.recipe, tmp / "ffnquant")
        paths = {"ffnquant fp32": tmp / "ffnquant" / "model.fp32.onnx", f"ffnquant {args.recipe}": tmp / "ffnquant" / "model.onnx"}
        genai, genai_how = _genai_int4(model, tmp / "genai")
        if genai is not None:
            paths["onnxruntime-genai int4"] = genai
        sizes = {k: p.stat().st_size + sum(f.stat().st_size for f in p.parent.glob(p.name + ".data")) for k, p in paths.items()}
        rows = side_by_side(paths, contexts, args.rounds, args.per_round)
    doc = {"command": f"{COMMAND} {' '.join(argv or sys.argv[1:])}".strip(), "model": args.model or "small random Llama",
           "recipe": args.recipe, "genai": genai_how, "decoder": {k: graph["decoder"][k] for k in ("status",)},
           "generation_equal": graph["decoder"].get("generation", {}).get("equal"), "bytes": sizes, "contexts": rows}
    table = [(n, k, f"{r['p50_ms']:.3f} ({r['p10_ms']:.3f}-{r['p90_ms']:.3f})", f"{r['tokens_per_s']:.0f}",
              f"{rows[n]['ffnquant fp32']['p50_ms'] / r['p50_ms']:.2f}x") for n, row in rows.items() for k, r in row.items()]
    md = "\n".join([f"# Decode latency with a KV cache: {doc['model']}", "", f"Command: `{doc['command']}`", "",
                    f"onnxruntime-genai: {genai_how}", "",
                    markdown_table(["context", "graph", "p50 ms/token (p10-p90)", "tokens/s", "vs ffnquant fp32"], table),
                    "", "Bytes: " + ", ".join(f"{k} {v:,}" for k, v in sizes.items()), ""])
    print(md)
    if args.out:
        from ffnquant.infra.atomic import write_json, write_text

        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_json(Path(args.out) / "decode.json", doc)
        write_text(Path(args.out) / "decode.md", md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
