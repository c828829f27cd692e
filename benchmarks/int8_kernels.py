"""What onnxruntime's int8 CPU kernels do to ffnquant's artifacts on THIS machine, on a trained model's FFNs.

    PYTHONPATH=. python benchmarks/int8_kernels.py [--model models/smollm2-135m-instruct] [--layers 0,7,15,23,29]
        [--calib-tokens 512] [--eval-tokens 512] [--out reports/int8-kernels]

`ortcpu.int8_kernels` probes the kernels (a graph with a known answer). Then `ffnquant quantize --model` writes
each listed layer's static int8 artifact with u8 activations (w8a8) and with int8 activations (w8a8-s8), and
every artifact is run on onnxruntime's CPU provider three ways on the same held-out inputs: a default session,
ffnquant's session (`onnxquant.ort_session`: the int8-allowed entry where the probe says it helps), and the graph
as written (optimizations off: DequantizeLinear then a float MatMul, the exact value). Each figure is the layer's
output SQNR against the float layer, beside ffnquant's torch reference of the same recipe. Writes int8_kernels.json
and int8_kernels.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _default_session(path: str):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def _latency(cases: dict[str, tuple[str, str]], d: int, tokens=(1, 512), rounds: int = 15) -> dict[str, dict[str, float]]:
    """{case: {tokens: median ms}}: each session run once per round at each size, rounds interleaved."""
    import numpy as np

    from ffnquant.onnx.onnxquant import ort_session

    sessions = {k: _default_session(p) if how == "default" else ort_session(p) for k, (p, how) in cases.items()}
    x = {m: np.random.default_rng(0).standard_normal((1, m, d)).astype(np.float32) for m in tokens}
    times: dict[tuple[str, int], list[float]] = {(k, m): [] for k in sessions for m in tokens}
    for k, sess in sessions.items():
        for m in tokens:
            sess.run(None, {"input": x[m]})
    for _ in range(rounds):
        for m in tokens:
            for k, sess in sessions.items():
                t = time.perf_counter()
                sess.run(None, {"input": x[m]})
                times[k, m].append(time.perf_counter() - t)
    return {k: {str(m): float(np.median(times[k, m]) * 1e3) for m in tokens} for k in sessions}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--layers", default="0,7,15,23,29")
    ap.add_argument("--calib-tokens", type=int, default=512)
    ap.add_argument("--eval-tokens", type=int, default=512)
    ap.add_argument("--out", default=str(ROOT / "reports" / "int8-kernels"))
    args = ap.parse_args(argv)

    import torch

    from ffnquant.numerics.accuracy import sqnr_db
    from ffnquant.infra.atomic import write_json, write_text
    from ffnquant.infra.envinfo import environment
    from ffnquant.hf import EvalSettings, capture_layer_inputs, inspect_model, load_ffn_layers
    from ffnquant.onnx.onnxquant import ort_session, run_onnx
    from ffnquant.onnx.ortcpu import int8_kernels

    t0 = time.time()
    kernels = int8_kernels()
    info = inspect_model(args.model)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ffnquant-int8-kernels-") as tmp:
        runs = {}
        for scheme in ("w8a8", "w8a8-s8"):
            cmd = [sys.executable, "-m", "ffnquant", "quantize", "--model", args.model, "--scheme", scheme,
                   "--calibrator", "minmax", "--layers", args.layers, "--calib-tokens", str(args.calib_tokens),
                   "--eval-tokens", str(args.eval_tokens), "--no-ablation", "--no-progress",
                   "--out-artifacts", f"{tmp}/{scheme}", "--out-reports", f"{tmp}/{scheme}-reports"]
            subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
            doc = json.loads(next(Path(f"{tmp}/{scheme}-reports").glob("quantize_*.json")).read_text())
            runs[scheme] = {r["label"]: r for r in doc["layers"]}
        # the same held-out inputs the command measured on (its defaults: the shipped texts)
        layers = load_ffn_layers(info, args.layers)
        settings = EvalSettings(max_calib_tokens=args.calib_tokens, max_eval_tokens=args.eval_tokens)
        inputs = capture_layer_inputs(info, layers, calib_tokens=args.calib_tokens, eval_tokens=args.eval_tokens,
                                      settings=settings)
        for layer in layers:
            x = inputs.eval[layer.label]
            with torch.no_grad():
                ref = layer.ffn(x)
            row = {"layer": layer.label}
            for scheme, key in (("w8a8", "u8"), ("w8a8-s8", "s8")):
                r = runs[scheme][layer.label]
                path = r["artifact"]["path"]
                row[f"{key}_torch_db"] = r["accuracy_torch"]["sqnr_db"]
                row[f"{key}_default_db"] = sqnr_db(ref, run_onnx(_default_session(path), x))
                row[f"{key}_ffnquant_db"] = sqnr_db(ref, run_onnx(ort_session(path), x))
                row[f"{key}_graph_db"] = sqnr_db(ref, run_onnx(ort_session(path, as_written=True), x))
                row[f"{key}_reported_db"] = r["artifact"]["accuracy_onnx"]["sqnr_db"]
            rows.append(row)
        # latency of the first layer's artifacts in a default and in ffnquant's session, interleaved rounds
        first = layers[0].label
        timings = _latency({f"{scheme} {how}": (runs[scheme][first]["artifact"]["path"], how)
                            for scheme in ("w8a8", "w8a8-s8") for how in ("default", "ffnquant")}, info.spec.d_model)
    res = {"command": " ".join(["PYTHONPATH=. python benchmarks/int8_kernels.py", *(argv if argv is not None else sys.argv[1:])]),
           "model": info.path.name if hasattr(info.path, "name") else str(info.path), "layers": args.layers,
           "calib_tokens": args.calib_tokens, "eval_tokens": args.eval_tokens, "kernels": kernels.to_dict(),
           "rows": rows, "latency_layer": first, "latency_ms": timings, "seconds": time.time() - t0,
           "environment": environment()}
    out = Path(args.out)
    write_json(out / "int8_kernels.json", res)
    write_text(out / "int8_kernels.md", _markdown(res))
    print(_markdown(res))
    return 0


def _markdown(res: dict) -> str:
    from ffnquant.infra.render import markdown_table

    k, env = res["kernels"], res["environment"]
    f = lambda v: f"{v:.2f}"  # noqa: E731
    rows = [[r["layer"], f(r["u8_torch_db"]), f(r["u8_default_db"]), f(r["u8_graph_db"]), f(r["s8_torch_db"]),
             f(r["s8_default_db"]), f(r["s8_ffnquant_db"]), f(r["s8_graph_db"])] for r in res["rows"]]
    lines = [
        "# onnxruntime's int8 CPU kernels on this machine", "",
        f"Command: `{res['command']}`", "",
        f"Probe (`ffnquant.onnx.ortcpu.int8_kernels`, a QDQ MatMul with a known answer): u8 activations exact: "
        f"{k['u8_exact']}; int8 activations exact in a default session: {k['s8_exact_default']}, with "
        f"`session.qdqisint8allowed=1`: {k['s8_exact_int8_allowed']}; CPU flags: {', '.join(k['flags']) or 'unknown'}. "
        f"{k['summary']}.", "",
        f"Model {res['model']}, layers {res['layers']}: each FFN's static int8 artifact (`quantize --model`, minmax "
        f"calibration on {res['calib_tokens']} tokens), its output SQNR (dB) against the float layer on "
        f"{res['eval_tokens']} held-out tokens. torch: ffnquant's reference of the recipe; default: a plain "
        "onnxruntime session; ffnquant: `onnxquant.ort_session` (sets the int8-allowed entry where the probe says it "
        "helps); graph: graph optimizations off (DequantizeLinear then a float MatMul), the artifact's exact value.", "",
        markdown_table(["layer", "w8a8 torch", "w8a8 default", "w8a8 graph", "w8a8-s8 torch", "w8a8-s8 default",
                        "w8a8-s8 ffnquant", "w8a8-s8 graph"], rows), "",
        f"Latency of {res['latency_layer']}'s artifacts (median ms of interleaved rounds, batch 1):", "",
        markdown_table(["artifact, session", *(f"{m} tokens" for m in next(iter(res["latency_ms"].values())))],
                       [[k, *(f"{v:.3f}" for v in t.values())] for k, t in res["latency_ms"].items()]), "",
        f"_{env['timestamp_utc']} on {env['cpu']} ({env['cpu_count']} cores), onnxruntime "
        f"{env['packages'].get('onnxruntime') or env['packages'].get('onnxruntime-gpu')}, torch "
        f"{env['packages']['torch']}; {res['seconds']:.0f} s_", "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
