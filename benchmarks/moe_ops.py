"""Routed experts on onnxruntime's CPU: the float MoE node of ffnquant's fp32 graph against the QMoE node of its
quantized graph, one experts layer at the shapes of real MoE models, side by side in one run.

    PYTHONPATH=. python benchmarks/moe_ops.py [--shapes qwen3-30b-a3b,gpt-oss-20b,olmoe-1b-7b]
        [--recipes w4a16-g32,w4a16-g128,w8a16] [--tokens 1,16,128,512] [--rounds 5] --out reports/moe-ops

Per shape (hidden width, expert width, experts, experts per token, activation, biases: the models' own configs),
one layer of random experts and, per recipe, ffnquant's own quantizer makes every expert's codes (round to
nearest, `methods.quantize_linear`) and `deploy.onnx_experts.quantized_experts` makes QMoE's tensors from them,
as an export does. The two nodes are written as `deploy.onnx_experts.GraphExperts` writes them (the float node
with its routing-weight logarithms, the Concat that keeps its input read and the scale back; QMoE with the routing
weights given), the float one holding the dequantized weights: so it is both the latency baseline and the exact
answer QMoE must give. Each token count is routed at random (a softmax's top k), the same rows for both nodes.

Latency: interleaved rounds (every node and size in each round), p50 ms per call and the speedup. Accuracy: QMoE's
largest difference from the float node, relative to the output's largest magnitude (float32 rounding only: the
same weights). Random weights: the latency does not depend on the values, and the exactness is of the codes.
Writes moe_ops.json and moe_ops.md.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the routed-experts layer of each model's config.json (hidden_size, moe_intermediate_size / intermediate_size,
# number of experts, experts per token), its activation and whether its experts have biases
SHAPES = {
    "qwen3-30b-a3b": dict(d=2048, f=768, experts=128, k=8, op=("swiglu", 1.0, 0.0, None), bias=False),
    "gpt-oss-20b": dict(d=2880, f=2880, experts=32, k=4, op=("swiglu", 1.702, 1.0, 7.0), bias=True),
    "olmoe-1b-7b": dict(d=2048, f=1024, experts=64, k=8, op=("swiglu", 1.0, 0.0, None), bias=False),
}


def _experts(shape: dict, recipe: str, seed: int = 0):
    """(QMoE's tensors, dequantized fc1 [E, 2f, d] and fc2 [E, d, f], biases): every expert's gate, up and down
    quantized by ffnquant's handler under `recipe`, codes to tensors by `quantized_experts`."""
    import torch

    from ffnquant.deploy.onnx_experts import quantized_experts
    from ffnquant.deploy.planned import ModuleQuant
    from ffnquant.methods import quantize_linear
    from ffnquant.recipe import Recipe

    scheme = Recipe.parse(recipe).resolve()
    gen = torch.Generator().manual_seed(seed)
    d, f, n = shape["d"], shape["f"], shape["experts"]
    modules, dequant = [], {}
    for e in range(n):
        for weight, (rows, cols) in (("w_gate", (f, d)), ("w_up", (f, d)), ("w_down", (d, f))):
            w = torch.randn(rows, cols, generator=gen) / cols ** 0.5
            q = quantize_linear(w, scheme)
            dequant[e, weight] = q.weight.float()
            modules.append(ModuleQuant(module=f"experts.{e}.{weight}", layer="L0", index=0, weight=weight,
                                       site="input" if weight != "w_down" else "hidden", recipe=recipe, scheme=scheme,
                                       grid=q.grid, input_mode=None, input_range=None, codes=q.codes, expert=e,
                                       fused="experts"))
    tensors = quantized_experts(modules, lambda mq: dequant[mq.expert, mq.weight], d, f, gated=True)
    gate = torch.stack([dequant[e, "w_gate"] for e in range(n)])
    up = torch.stack([dequant[e, "w_up"] for e in range(n)])
    fc1 = torch.stack([gate, up], 2).reshape(n, 2 * f, d).numpy()
    fc2 = torch.stack([dequant[e, "w_down"] for e in range(n)]).numpy()
    b1 = b2 = None
    if shape["bias"]:
        b1 = (torch.randn(n, 2 * f, generator=gen) * 0.1).numpy()
        b2 = (torch.randn(n, d, generator=gen) * 0.1).numpy()
    return tensors, fc1, fc2, b1, b2


def _graphs(shape: dict, tensors: dict, fc1, fc2, b1, b2, folder: Path) -> dict[str, str]:
    """The float MoE node and the QMoE node as ffnquant's graphs hold them (inputs x, chosen, dense), written into
    `folder` (weights as external data: one layer of 128 float experts is more than a protobuf holds)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from ffnquant.onnx.moe import MS_DOMAIN, ExpertsOp

    act, alpha, beta, limit = shape["op"]
    attrs = ExpertsOp(act, shape["k"], alpha, beta, limit).attributes()
    d, n = shape["d"], shape["experts"]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", d]),
              helper.make_tensor_value_info("chosen", TensorProto.FLOAT, ["T", n]),
              helper.make_tensor_value_info("dense", TensorProto.FLOAT, ["T", n])]
    out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", d])]
    biases = {"b1": b1, "b2": b2}

    def model(nodes, inits, name: str) -> str:
        graph = helper.make_graph(nodes, "experts", inputs, out,
                                  initializer=[numpy_helper.from_array(v, k) for k, v in inits.items() if v is not None])
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS_DOMAIN, 1)])
        m.ir_version = 10
        path = folder / f"{name}.onnx"
        onnx.save_model(m, str(path), save_as_external_data=True, location=f"{name}.data")
        return str(path)

    b = lambda key: key if biases[key] is not None else ""  # noqa: E731
    float_nodes = [
        helper.make_node("Clip", ["dense", "tiny"], ["clipped"]), helper.make_node("Log", ["clipped"], ["logw"]),
        helper.make_node("Greater", ["chosen", "zero"], ["is_chosen"]),
        helper.make_node("Where", ["is_chosen", "logw", "minus_inf"], ["logits"]),
        helper.make_node("MoE", ["x", "logits", "fc1", b("b1"), "fc2", b("b2")], ["moe"], domain=MS_DOMAIN, **attrs),
        helper.make_node("Concat", ["moe", "x"], ["both"], axis=-1),
        helper.make_node("Slice", ["both", "start", "width", "last"], ["kept"]),
        helper.make_node("ReduceSum", ["dense", "last"], ["total"], keepdims=1),
        helper.make_node("Mul", ["kept", "total"], ["y"])]
    consts = {"tiny": np.array(1e-37, np.float32), "zero": np.array(0.0, np.float32),
              "minus_inf": np.array(-np.inf, np.float32), "start": np.array([0]), "width": np.array([d]),
              "last": np.array([-1])}
    q = {f"{fc}_{part}": array for fc in ("fc1", "fc2") for part, array in tensors[fc].items()}
    qattrs = dict(attrs, expert_weight_bits=int(tensors["bits"]), **({"block_size": int(tensors["block"])}
                                                                       if tensors["block"] else {}))
    z = lambda key: key if key in q else ""  # noqa: E731
    qnode = helper.make_node("QMoE", ["x", "chosen", "fc1_weights", "fc1_scales", b("b1"), "fc2_weights", "fc2_scales",
                                      b("b2"), "", "", "", z("fc1_zero_points"), z("fc2_zero_points"), "", "dense"],
                             ["y"], domain=MS_DOMAIN, **qattrs)
    return {"float MoE": model(float_nodes, {**consts, "fc1": fc1, "fc2": fc2, **biases}, "float"),
            "QMoE": model([qnode], {**q, **biases}, "qmoe")}


def _feeds(shape: dict, tokens, seed: int = 1) -> dict[int, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = {}
    for t in tokens:
        logits = rng.standard_normal((t, shape["experts"])).astype(np.float32)
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        index = np.argsort(-p, 1)[:, :shape["k"]]
        dense = np.zeros_like(p)
        np.put_along_axis(dense, index, np.take_along_axis(p, index, 1), 1)
        out[t] = {"x": rng.standard_normal((t, shape["d"])).astype(np.float32), "chosen": (dense > 0).astype(np.float32),
                  "dense": dense}
    return out


def run(shapes, recipes, tokens, rounds: int) -> dict:
    import onnxruntime as ort

    from ffnquant.deploy.onnx_decoder import interleaved_times
    from ffnquant.measure.latency import latency_stats

    from ffnquant.errors import FFNQuantError

    rows = []
    for name in shapes:
        shape = SHAPES[name]
        feeds = _feeds(shape, tokens)
        for recipe in recipes:
            t0 = time.perf_counter()
            try:
                tensors, fc1, fc2, b1, b2 = _experts(shape, recipe)
            except FFNQuantError as exc:  # a grid QMoE does not store at this shape: the reason is the row
                rows.append({"shape": name, "recipe": recipe, "reason": str(exc)})
                print(f"{name} {recipe}: {exc}", flush=True)
                continue
            opts = ort.SessionOptions()
            opts.log_severity_level = 3
            with tempfile.TemporaryDirectory(prefix="moe-ops-") as tmp:
                sessions = {k: ort.InferenceSession(g, opts, providers=["CPUExecutionProvider"])
                            for k, g in _graphs(shape, tensors, fc1, fc2, b1, b2, Path(tmp)).items()}
            del fc1, fc2
            gc.collect()
            times = interleaved_times(sessions, feeds, warmup=1, rounds=rounds, per_round=1)
            for t, feed in feeds.items():
                want, got = (sessions[k].run(["y"], feed)[0] for k in ("float MoE", "QMoE"))
                p50 = {k: latency_stats(times[k, t]).median_s * 1e3 for k in sessions}
                rows.append({"shape": name, "recipe": recipe, "bits": tensors["bits"], "block": tensors["block"],
                             "tokens": t, "float_ms": p50["float MoE"], "qmoe_ms": p50["QMoE"],
                             "speedup": p50["float MoE"] / p50["QMoE"],
                             "max_rel_diff": float(np.abs(got - want).max() / (np.abs(want).max() + 1e-30)),
                             "provider": sessions["QMoE"].get_providers()[0]})
                print(f"{name} {recipe} {t} tokens: float MoE {p50['float MoE']:.2f} ms, QMoE {p50['QMoE']:.2f} ms "
                      f"({rows[-1]['speedup']:.2f}x), max rel diff {rows[-1]['max_rel_diff']:.1e}", flush=True)
            print(f"[{name} {recipe}: {time.perf_counter() - t0:.0f} s]", flush=True)
            del sessions
            gc.collect()
    return {"rows": rows, "rounds": rounds}


def markdown(doc: dict) -> str:
    env = doc["environment"]
    lines = ["# Routed experts on onnxruntime's CPU: float MoE against QMoE", "",
             f"Command: `{doc['command']}`", "",
             f"Machine: {env.get('cpu', '?')} ({env.get('cpu_count', '?')} cores); onnxruntime {doc['onnxruntime']}, "
             f"provider {next((r['provider'] for r in doc['rows'] if 'provider' in r), '-')}; "
             f"{doc['rounds']} interleaved rounds, p50 per call; written {doc['written']}.", "",
             "One experts layer of random weights at each model's shapes (the latency does not depend on the values); "
             "the float node holds the dequantized weights, so `max rel diff` is QMoE's float32 rounding alone.", "",
             "| shape | recipe | tokens | float MoE ms | QMoE ms | speedup | max rel diff |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        if "reason" in r:
            lines.append(f"| {r['shape']} | {r['recipe']} | - | - | - | - | not stored: {r['reason']} |")
            continue
        lines.append(f"| {r['shape']} | {r['recipe']} | {r['tokens']} | {r['float_ms']:.2f} | {r['qmoe_ms']:.2f} | "
                     f"{r['speedup']:.2f}x | {r['max_rel_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--recipes", default="w4a16-g32,w4a16-g128,w8a16")
    ap.add_argument("--tokens", default="1,16,128,512")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        print(f"unknown shape(s) {', '.join(unknown)}; valid: {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    import onnxruntime as ort

    from ffnquant.infra.envinfo import environment

    doc = run(shapes, [r for r in args.recipes.split(",") if r], [int(t) for t in args.tokens.split(",")], args.rounds)
    doc.update(command="python benchmarks/moe_ops.py " + " ".join(sys.argv[1:]), onnxruntime=ort.__version__,
               environment=environment(), written=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    from ffnquant.infra.atomic import write_json, write_text

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "moe_ops.json", doc)  # each file whole or not at all
    print(f"wrote {write_text(out / 'moe_ops.md', markdown(doc))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
