"""W4A16 kernel micro-benchmark: fp16 cuBLAS vs the old Triton kernel vs the tiled one, per FFN projection.

    PYTHONPATH=. python benchmarks/w4a16_kernels.py [--d-model 4096] [--d-ff 11008] [--group 128] [--act silu]
        [--tokens 1,4,16,64,512,2048] [--out reports/w4a16-kernels] [--asym] [--dry-run]

A gated FFN's two projections at each token count M: gate+up fused (act(x Wg^T) * (x Wu^T); fp16 runs one
cuBLAS matmul on the concatenated [2 d_ff, d_model] weight, then the activation and product) and down
([M, d_ff] -> [M, d_model]). Kernels: `fp16` (torch matmul on the dequantized weights in fp16), `w4a16`
(`ffnquant.kernels.w4a16`, the baseline Triton kernel) and `w4a16_tiled` (`ffnquant.kernels.w4a16_tiled`).
Each is timed as a CUDA-graph replay with the L2 flushed before each replay (`kernels.tritonenv.time_call`; the first
call, outside the timing, compiles and tunes). Reported per row: time, speedup over fp16, achieved GB/s
counting the bytes of weights + scales + x + out once (the logical int4 bytes for both quantized kernels:
same data, padding not credited) and that rate as a fraction of the device's HBM peak (`ffnquant.measure.latency`).
Every quantized output is checked against `w4a16_reference` / `w4a16_gated_reference` with the derived
tolerance of the tests (`w4a16_repack.matmul_error_bound` / `gated_error_bound`, u = 2**-23 on CUDA); a kernel
outside it is marked DIFFERS. The fp16 rows compute another thing (weights rounded to fp16): not checked.

--asym quantizes the weights with the `w4a16-g*-asym` presets' zero points (`pack_w4(..., symmetric=False)`) and
runs fp16 and `w4a16_tiled` only (the old kernel has symmetric groups only); the quantized bytes then count the
uint8 zero points too.

--dry-run runs the same code paths on CPU tensors in Triton's interpreter at tiny shapes (d_model 128,
d_ff 256, M = 1, 4 unless given) without timing. Without CUDA and without --dry-run: exit 2.
Writes w4a16_kernels.json and w4a16_kernels.md into --out.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ("fp16", "w4a16", "w4a16_tiled")
ASYM_KERNELS = ("fp16", "w4a16_tiled")  # the old kernel hard-codes zero point 8


def _gpu_stamp() -> dict:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout.strip().splitlines()
        name, driver = (s.strip() for s in out[0].split(",", 1))
        return {"name": name, "driver": driver}
    except Exception as exc:  # no nvidia-smi (CPU dry run): say so instead of failing
        return {"name": None, "driver": None, "why": f"nvidia-smi unavailable: {type(exc).__name__}"}


def _parse_tokens(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        vals = ()
    if not vals or min(vals) < 1:
        raise SystemExit(f"--tokens must be positive integers separated by commas, got {text!r}")
    return vals


def run(args) -> dict:
    import torch

    from ffnquant.kernels import w4a16, w4a16_tiled
    from ffnquant.kernels.w4a16_pack import dequantize_w4, pack_w4, torch_act, w4a16_gated_reference, w4a16_reference
    from ffnquant.kernels.w4a16_repack import gated_error_bound, matmul_error_bound, repack_w4
    from ffnquant.kernels.tritonenv import time_call
    from ffnquant.measure.latency import device_peaks

    dev = "cpu" if args.dry_run else "cuda"
    dtype = torch.float16
    u = 2.0**-24 if args.dry_run else 2.0**-23  # tensor-core float32 accumulation is not round-to-nearest
    gen = torch.Generator().manual_seed(args.seed)
    d, f, g = args.d_model, args.d_ff, args.group
    sym = not args.asym
    p_gate, p_up, p_down = (pack_w4(torch.randn(*shape, generator=gen) * 0.02, g, symmetric=sym).to(dev)
                            for shape in ((f, d), (f, d), (d, f)))
    kernels = KERNELS if sym else ASYM_KERNELS
    t_gate, t_up, t_down = (repack_w4(p, w4a16_tiled.LAYOUT_BLOCK_N) for p in (p_gate, p_up, p_down))  # on dev
    w_gu = torch.cat([dequantize_w4(p_gate), dequantize_w4(p_up)]).to(dev, dtype)
    w_dn = dequantize_w4(p_down).to(dev, dtype)
    act_fn = torch_act(args.act)
    name = torch.cuda.get_device_name(0) if dev == "cuda" else None
    peaks = device_peaks(name)
    peak_bw = peaks.memory_bytes_per_s if peaks is not None else None
    quant_bytes = {"gate_up": p_gate.nbytes + p_up.nbytes, "down": p_down.nbytes}
    fp16_bytes = {"gate_up": w_gu.numel() * 2, "down": w_dn.numel() * 2}
    rows, skipped, t_start = [], [], time.perf_counter()
    for m in args.tokens:
        if time.perf_counter() - t_start > args.max_s:  # a device session's stage has a hard limit: end with a report
            skipped.append(m)
            continue
        x = (torch.randn(m, d, generator=gen)).to(dev, dtype)
        h = w4a16_gated_reference(x, p_gate, p_up, args.act)  # the same down input for every kernel
        refs = {"gate_up": h, "down": w4a16_reference(h, p_down)}
        bounds = {"gate_up": gated_error_bound(x, p_gate, p_up, args.act, refs["gate_up"], dtype, u),
                  "down": matmul_error_bound(h, p_down, refs["down"], dtype, u)}
        calls = {
            ("gate_up", "fp16"): lambda x=x: _fp16_gated(x, w_gu, f, act_fn),
            ("gate_up", "w4a16"): lambda x=x: w4a16.w4a16_gated(x, p_gate, p_up, args.act),
            ("gate_up", "w4a16_tiled"): lambda x=x: w4a16_tiled.tiled_gated(x, t_gate, t_up, args.act),
            ("down", "fp16"): lambda h=h: h @ w_dn.T,
            ("down", "w4a16"): lambda h=h: w4a16.w4a16_matmul(h, p_down),
            ("down", "w4a16_tiled"): lambda h=h: w4a16_tiled.tiled_matmul(h, t_down),
        }
        for proj in ("gate_up", "down"):
            n_in, n_out = (d, f) if proj == "gate_up" else (f, d)
            io = (n_in + n_out) * m * 2
            fp16_ms = None
            for kernel in kernels:
                fn = calls[proj, kernel]
                t0 = time.perf_counter()
                ms = None if args.dry_run else time_call(fn)  # its first call compiles and tunes
                y = fn()
                row = {"projection": proj, "m": m, "kernel": kernel, "time_us": None if ms is None else ms * 1e3,
                       "wall_s": round(time.perf_counter() - t0, 3)}
                nbytes = (fp16_bytes if kernel == "fp16" else quant_bytes)[proj] + io
                row["bytes"] = nbytes
                if kernel == "fp16":
                    fp16_ms = ms
                    row.update(check="n/a (fp16 weights)", max_abs_err=None, worst_excess=None, config=None)
                else:
                    err = (y.float() - refs[proj].float()).abs()
                    finite = bool(torch.isfinite(y.float()).all())
                    excess = float((err - bounds[proj]).max()) if finite else None  # JSON has no NaN
                    gated = proj == "gate_up"
                    row.update(check="ok" if finite and excess <= 0 else "DIFFERS",
                               max_abs_err=float(err.max()) if finite else None, worst_excess=excess,
                               config=_config(kernel, x if gated else h, p_gate if gated else p_down,
                                              t_gate if gated else t_down, gated))
                row["speedup_vs_fp16"] = fp16_ms / ms if ms and fp16_ms else None
                row["gbps"] = nbytes / (ms * 1e-3) / 1e9 if ms else None
                row["roofline_frac"] = row["gbps"] * 1e9 / peak_bw if row["gbps"] and peak_bw else None
                rows.append(row)
    return {"rows": rows, "not_measured_m": skipped, "peak_bytes_per_s": peak_bw,
            "device": name or "cpu (Triton interpreter)"}


def _fp16_gated(x, w_gu, d_ff: int, act_fn):
    y = x @ w_gu.T  # gate and up as one cuBLAS matmul on the concatenated weight
    return act_fn(y[:, :d_ff]) * y[:, d_ff:]


def _config(kernel: str, x, p, t, gated: bool):
    from dataclasses import asdict

    from ffnquant.kernels import w4a16, w4a16_tiled

    cfg = w4a16.w4a16_config_used(x, p, gated) if kernel == "w4a16" else w4a16_tiled.tiled_config_used(x, t, gated)
    return asdict(cfg) if cfg is not None else None


def _markdown(res: dict) -> str:
    from ffnquant.infra.render import markdown_table

    s = res["settings"]
    env = res["environment"]
    stamp = (f"{res['device']}; driver {env['gpu'].get('driver')}; torch {env['torch']}, triton {env['triton']}; "
             f"{s['timing']}; {res['wall_s']:.0f} s in all.")
    kind = "asymmetric (zero points)" if s.get("asym") else "symmetric"
    title = (f"# W4A16 kernels: d_model {s['d_model']}, d_ff {s['d_ff']}, group {s['group']} {kind}, {s['act']}, "
             "fp16 x")
    lines = [title, "", stamp, ""]

    def num(v, spec):
        return "-" if v is None else format(v, spec)

    cfg = lambda c: "-" if not c else f"{c['path']} {c['block_m']}x{c['block_n']} sk{c['split_k']} w{c['num_warps']}"
    lines.append(markdown_table(
        ["projection", "M", "kernel", "us", "vs fp16", "GB/s", "of HBM peak", "check", "config"],
        [[r["projection"], r["m"], r["kernel"], num(r["time_us"], ".1f"), num(r["speedup_vs_fp16"], ".2f"),
          num(r["gbps"], ".0f"), num(r["roofline_frac"], ".0%"), r["check"], cfg(r["config"])] for r in res["rows"]]))
    if res.get("not_measured_m"):
        lines += ["", f"Not measured: M = {', '.join(map(str, res['not_measured_m']))} (the run passed --max-s "
                      f"{s['max_s']:g} s before starting them)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=None, help="default 4096 (128 with --dry-run)")
    ap.add_argument("--d-ff", type=int, default=None, help="default 11008 (256 with --dry-run)")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--act", default="silu")
    ap.add_argument("--tokens", default=None, help="comma-separated M values; default 1,4,16,64,512,2048 (1,4 dry)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "reports" / "w4a16-kernels"))
    ap.add_argument("--asym", action="store_true",
                    help="asymmetric groups (w4a16-g*-asym zero points): fp16 and the tiled kernel only")
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes, nothing timed")
    ap.add_argument("--max-s", type=float, default=75.0,
                    help="start no new M after this many seconds, so the report is written within a stage's limit")
    args = ap.parse_args(argv)
    dry = args.dry_run
    args.d_model = args.d_model or (128 if dry else 4096)
    args.d_ff = args.d_ff or (256 if dry else 11008)
    args.tokens = _parse_tokens(args.tokens or ("1,4" if dry else "1,4,16,64,512,2048"))

    import torch

    if dry:
        os.environ["TRITON_INTERPRET"] = "1"  # the kernels are decorated per mode at first use: not too late here
    elif not torch.cuda.is_available():
        print("w4a16_kernels: no CUDA device here; run on a GPU, or pass --dry-run for the CPU interpreter",
              file=sys.stderr)
        return 2

    import triton

    from ffnquant.infra.atomic import write_json, write_text
    from ffnquant.infra.envinfo import environment
    from ffnquant.errors import FFNQuantError

    t0 = time.time()
    try:
        res = run(args)
    except FFNQuantError as exc:
        print(f"w4a16_kernels: {exc}", file=sys.stderr)
        return 2
    res["settings"] = {"d_model": args.d_model, "d_ff": args.d_ff, "group": args.group, "asym": args.asym,
                       "act": args.act,
                       "tokens": list(args.tokens), "dtype": "float16", "dry_run": dry, "seed": args.seed,
                       "max_s": args.max_s,
                       "timing": ("not timed (dry run: Triton interpreter on CPU)" if dry else
                                  "CUDA graph replay, L2 flushed per replay, median of triton.testing.do_bench")}
    res["environment"] = {"gpu": _gpu_stamp(), "torch": torch.__version__, "triton": triton.__version__,
                          "machine": environment()}
    res["command"] = " ".join(["PYTHONPATH=. python benchmarks/w4a16_kernels.py",
                               *(argv if argv is not None else sys.argv[1:])])
    res["wall_s"] = time.time() - t0
    out = Path(args.out)
    write_json(out / "w4a16_kernels.json", res)
    md = _markdown(res)
    write_text(out / "w4a16_kernels.md", md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
