"""Fused activation quantization (ffnquant.kernels.actquant) against bf16 and the unfused int8 / fp8 torch paths.

    PYTHONPATH=. python benchmarks/actquant_kernels.py [--d-model 4096] [--d-ff 11008] [--tokens 1,16,512,2048]
        [--reps 30] [--out reports/actquant-kernels] [--dry-run]

One SwiGLU FFN (deterministic weights, `ffnquant.model.build`), bf16 activations, five paths: the bf16 torch FFN,
the unfused torch paths of w8a8-dynamic-s8 and fp8-e4m3-dynamic (torch_rt's `Int8DynamicLinear` /
`Fp8RowwiseLinear` per Linear, as the torch runtime loads them), and the fused modules (`FusedInt8GatedFFN`,
`FusedFp8GatedFFN`). Each is timed eager (wall time of one call with torch.cuda.synchronize, median of --reps)
and replayed from a CUDA graph (triton.testing.do_bench of the replay, median, L2 flushed between replays);
speedups are against bf16 in the same mode, and each output's SQNR is against the float32 FFN on the same input.
Writes actquant_kernels.json and actquant_kernels.md under --out, stamped with the GPU, torch and triton.

--dry-run runs the same paths on CPU in Triton's interpreter at tiny shapes (eager only; not a measurement) and
writes actquant_kernels_dry_run.{json,md}. Without CUDA and without --dry-run: exit 2.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("bf16", "int8-unfused", "fp8-unfused", "int8-fused", "fp8-fused")


def _paths(model, device, dtype):
    """{name: module or the reason it cannot run here}."""
    import torch

    from ffnquant.kernels.actquant_ffn import fused_ffn
    from ffnquant.runtimes.torch_rt import unfused_ffn

    out: dict = {"bf16": copy.deepcopy(model).to(device=device, dtype=dtype).eval()}
    for kind in ("int8", "fp8"):
        for name, make in ((f"{kind}-unfused", lambda k=kind: unfused_ffn(model, k, device, dtype)),
                           (f"{kind}-fused", lambda k=kind: fused_ffn(model, k, device).eval())):
            try:
                module = make()
                with torch.inference_mode():  # a tiny probe: kernels exist or not per device and torch version
                    module(torch.randn(2, model.spec.d_model, device=device, dtype=dtype))
                out[name] = module
            except Exception as exc:
                text = str(exc).strip()
                out[name] = f"unavailable: {type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    return out


def _eager_ms(fn, x, reps: int, cuda: bool) -> float:
    import torch

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.inference_mode():
        for _ in range(3):
            fn(x)
        sync()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn(x)
            sync()
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _graph_ms(module, x) -> float:
    from triton.testing import do_bench

    from ffnquant.runtimes.torch_rt import CapturedCall

    call = CapturedCall(module, x)
    return float(do_bench(call.replay, warmup=10, rep=100, return_mode="median"))


def _markdown(doc: dict) -> str:
    st = doc["stamp"]
    cfg = doc["config"]
    title = (f"# Fused activation quantization: {cfg['variant']} d_model {cfg['d_model']}, d_ff {cfg['d_ff']}, "
             f"{cfg['dtype']} activations")
    where = f"{st['label']}. GPU: {st['gpu']}; torch {st['torch']}; triton {st['triton']}; {st['timestamp_utc']}."
    how = ("Eager: median wall time of one call with torch.cuda.synchronize. Graph: median CUDA-graph replay "
           "(triton.testing.do_bench, L2 flushed). Speedup: bf16's time over the path's, same mode. SQNR: against "
           "the float32 FFN on the same input.")
    lines = [title, "", where, "", how, "",
             "| tokens | path | eager ms | eager speedup | graph ms | graph speedup | SQNR dB |",
             "|---:|---|---:|---:|---:|---:|---:|"]

    def num(v, fmt, unit=""):
        return "-" if v is None else format(v, fmt) + unit

    for r in doc["rows"]:
        if r.get("error"):
            lines.append(f"| {r['tokens']} | {r['path']} | {r['error']} | | | | |")
            continue
        lines.append(f"| {r['tokens']} | {r['path']} | {num(r['eager_ms'], '.4f')} | {num(r['eager_speedup'], '.2f', 'x')} "
                     f"| {num(r['graph_ms'], '.4f')} | {num(r['graph_speedup'], '.2f', 'x')} | {num(r['sqnr_db'], '.2f')} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--d-ff", type=int, default=11008)
    ap.add_argument("--tokens", default="1,16,512,2048", help="comma-separated token counts (rows of x)")
    ap.add_argument("--reps", type=int, default=30, help="eager calls timed per path and token count")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "reports" / "actquant-kernels"))
    ap.add_argument("--dry-run", action="store_true",
                    help="run the paths on CPU in Triton's interpreter at tiny shapes (eager only, not a measurement)")
    args = ap.parse_args(argv)

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(f"actquant_kernels: no CUDA device (torch {torch.__version__}); run it on a GPU, or pass --dry-run "
              "for the CPU interpreter check", file=sys.stderr)
        return 2
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before the first launch: the kernels are decorated per mode
        d_model, d_ff, tokens, reps = 64, 96, [1, 5], 2
        device = torch.device("cpu")
    else:
        d_model, d_ff, reps = args.d_model, args.d_ff, args.reps
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
        device = torch.device("cuda")
    import triton

    from ffnquant.numerics.accuracy import sqnr_db
    from ffnquant.infra.atomic import write_json, write_text
    from ffnquant.infra.envinfo import environment
    from ffnquant.model import build
    from ffnquant.spec import FFNSpec

    t0 = time.time()
    dtype = torch.bfloat16
    cuda = device.type == "cuda"
    model = build(FFNSpec("swiglu", d_model=d_model, d_ff=d_ff), seed=args.seed)
    reference = copy.deepcopy(model).to(device).eval()  # float32: the SQNR reference
    paths = _paths(model, device, dtype)
    rows = []
    for m in tokens:
        gen = torch.Generator().manual_seed(args.seed + m)
        x = torch.randn(m, d_model, generator=gen).to(device=device, dtype=dtype)
        with torch.inference_mode():
            y_ref = reference(x.float())
        base: dict = {}
        for name in PATHS:
            module = paths[name]
            if isinstance(module, str):
                rows.append({"tokens": m, "path": name, "error": module})
                continue
            with torch.inference_mode():
                y = module(x)
            row = {"tokens": m, "path": name, "sqnr_db": sqnr_db(y_ref.float().cpu(), y.float().cpu()),
                   "eager_ms": _eager_ms(module, x, reps, cuda), "graph_ms": _graph_ms(module, x) if cuda else None}
            if name == "bf16":
                base = row
            for mode in ("eager", "graph"):  # no speedups from the interpreter: its times are not the kernels'
                ms, ref_ms = row[f"{mode}_ms"], base.get(f"{mode}_ms")
                row[f"{mode}_speedup"] = ref_ms / ms if ms and ref_ms and not args.dry_run else None
            rows.append(row)
    stamp = {
        "label": ("dry run: CPU, Triton interpreter, tiny shapes, eager only (not a measurement)" if args.dry_run
                  else "measured on CUDA"),
        "gpu": torch.cuda.get_device_name(0) if cuda else "none (dry run)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.time() - t0, 1),
    }
    doc = {"stamp": stamp, "environment": environment(), "rows": rows,
           "config": {"variant": "swiglu", "d_model": d_model, "d_ff": d_ff, "tokens": tokens, "reps": reps,
                      "dtype": "bfloat16", "seed": args.seed, "dry_run": bool(args.dry_run)}}
    stem = "actquant_kernels_dry_run" if args.dry_run else "actquant_kernels"
    out = Path(args.out)
    write_json(out / f"{stem}.json", doc)
    write_text(out / f"{stem}.md", _markdown(doc))
    print(f"wrote {out / stem}.json and .md in {stamp['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
