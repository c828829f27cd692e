"""The plan's latency table on a GPU runtime: what `plan --objective latency --runtime R` measures, at a model's shape.

    PYTHONPATH=. python benchmarks/gpu_plan_latency.py [--variant swiglu --d-model 4096 --d-ff 14336 --layers 32]
        [--runtime triton-cuda,torch-cuda-graph] [--candidates LIST] [--tokens 512] [--decode-tokens 128]
        [--out reports/gpu-plan-latency] [--dry-run]

Every candidate recipe is timed on one FFN at the shape (`planning.runtime_latency.measure_runtime_table`, the plan's
own table: each recipe on the first listed runtime with a kernel for it, interleaved rounds, the runtime's
timer), and the FFN stack's request time (prefill + decode steps, times the layers) is set against the float
baseline's. The weights are random: latency does not depend on their values, and the device has no checkpoint
(the default shape is Llama-3-8B's FFN: d_model 4096, d_ff 14336, 32 layers).
`--dry-run` runs the same code on torch-cpu at a tiny shape (nothing on a GPU is claimed). Writes
gpu_plan_latency.json and .md to --out, stamped with the machine, the versions and the runtimes that ran.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GPU_CANDIDATES = "fp32,w8a16,w8a8-dynamic-s8,fp8-e4m3-dynamic,fp8-e4m3,w4a16-g128,w4a16-g128-asym,w4a16-g128-gptq,w8a8@search"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", default="swiglu")
    p.add_argument("--d-model", type=int, default=4096)
    p.add_argument("--d-ff", type=int, default=14336)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--runtime", default="triton-cuda,torch-cuda-graph")
    p.add_argument("--candidates", default=GPU_CANDIDATES)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="reports/gpu-plan-latency")
    p.add_argument("--dry-run", action="store_true", help="torch-cpu at d_model 128: the code paths, no GPU figure")
    args = p.parse_args(argv)
    if args.dry_run:
        args.runtime, args.d_model, args.d_ff, args.layers, args.tokens, args.decode_tokens, args.rounds = (
            "torch-cpu", 128, 256, 2, 16, 2, 2)

    from ffnquant.infra.envinfo import environment
    from ffnquant.errors import FFNQuantError
    from ffnquant.model import build
    from ffnquant.planning.runtime_latency import check_runtimes, measure_runtime_table
    from ffnquant.planning.target import Objective, Workload
    from ffnquant.recipe import Recipe
    from ffnquant.spec import FFNSpec, Variant
    from types import SimpleNamespace

    try:
        objective = Objective("latency", args.runtime, Workload(args.tokens, args.decode_tokens))
        runtimes = check_runtimes(objective.runtimes)
        spec, layers, source = FFNSpec(Variant(args.variant), d_model=args.d_model, d_ff=args.d_ff), args.layers, "given"
        recipes = [Recipe.parse(r) for r in args.candidates.split(",") if r.strip()]
        for r in recipes:
            r.check_fits(spec)
    except (FFNQuantError, ValueError) as exc:
        print(f"gpu_plan_latency: {exc}", file=sys.stderr)
        return 2
    layer = SimpleNamespace(spec=spec, ffn=build(spec, seed=0), label="L0")
    t0 = time.perf_counter()

    def progress(stage, done, total):
        print(f"[{time.perf_counter() - t0:6.1f}s] {stage} {done}/{total}", flush=True)

    table = measure_runtime_table(layer, recipes, runtimes, objective.tokens, rounds=args.rounds, progress=progress)
    base_key = next((str(r) for r in recipes if r.is_float), None)
    base = table.get(base_key, {}).get("p50_ms") if base_key else None
    rows = []
    for key, row in table.items():
        stack = row["p50_ms"] * layers if "p50_ms" in row else None
        rows.append({"recipe": key, **row, "stack_ms": stack,
                     "vs_float": (base / row["p50_ms"]) if base and row.get("p50_ms") else None})
    env = environment()
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    doc = {"command": "python benchmarks/gpu_plan_latency.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "dry_run": args.dry_run, "shape": {"variant": spec.variant.value, "d_model": spec.d_model, "d_ff": spec.d_ff,
                                             "layers": layers, "from": source},
           "objective": objective.name, "runtimes": {rt.name: rt.availability().reason for rt in runtimes},
           "rows": rows, "gpu": gpu, "environment": env, "seconds": time.perf_counter() - t0}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from ffnquant.infra.atomic import write_json, write_text
    from ffnquant.infra.render import markdown_table

    write_json(out / "gpu_plan_latency.json", doc)
    f = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    md = [f"# The plan's latency table{' (DRY RUN on CPU: no GPU figure)' if args.dry_run else ''}", "",
          f"Command: `{doc['command']}`", "",
          f"{spec.variant.value} d_model {spec.d_model}, d_ff {spec.d_ff}, {layers} layers ({source}); {objective.name}.",
          "Each FFN timed on the first listed runtime with a kernel for its scheme; the stack is one FFN's request "
          "time times the layers; `vs float` is the float baseline's request time over the row's.", "",
          markdown_table(["recipe", "runtime", "prefill p50 ms", "decode step p50 ms", "request p50 ms (one FFN)",
                          "FFN stack ms", "vs float", "kernel / why not"],
                         [(r["recipe"], r.get("runtime", "-"), f(r.get("prefill_ms")), f(r.get("decode_ms"), 4),
                           f(r.get("p50_ms")), f(r["stack_ms"], 1), f(r["vs_float"], 2) + ("x" if r["vs_float"] else ""),
                           r.get("reason") or f"{r['kernel']}; {r['note']}") for r in rows]), "",
          "Runtimes: " + "; ".join(f"{k}: {v}" for k, v in doc["runtimes"].items()), "",
          f"_{env.get('cpu', '')}; GPU {gpu}; "
          f"torch {env.get('packages', {}).get('torch', '-')}, triton {env.get('packages', {}).get('triton', '-')}; "
          f"{doc['seconds']:.0f} s_", ""]
    write_text(out / "gpu_plan_latency.md", "\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
