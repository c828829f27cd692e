"""Profiling cost: bounded memory (10x tokens, same peak) and throughput against a plain forward pass.

Run: PYTHONPATH=. python benchmarks/bench_profile.py [--out reports] [--quick]
Writes <out>/profile_benchmark.json and .md (command, environment, figures).

Memory: each token count runs in a fresh subprocess (so peaks do not mix) that streams
synthetic batches through `profile`; reported are the observer state size and the process's
peak RSS (VmHWM) during profiling. Throughput: the same pre-generated batches through a
plain forward pass and through `profile` (hooks + observers, weight statistics excluded),
interleaved, repeated; the ratio of medians is the profiling cost in forward passes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ffnquant import FFNSpec, build  # noqa: E402
from ffnquant.infra.atomic import write_json, write_text  # noqa: E402
from ffnquant.data import TokenSource  # noqa: E402
from ffnquant.infra.envinfo import environment  # noqa: E402
from ffnquant.numerics.observe import profile  # noqa: E402
from ffnquant.infra.render import markdown_table  # noqa: E402


def _vm_hwm_kib() -> int:
    with open("/proc/self/status", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return -1


def memory_child(variant: str, d_model: int, n_tokens: int, batch_size: int) -> dict:
    """Runs in a subprocess: profile `n_tokens` streamed tokens, report state size and peak RSS."""
    model = build(FFNSpec(variant, d_model=d_model), seed=0)
    src = TokenSource("gaussian", seed=0)
    # Warm-up batch so allocator pools and lazy inits are in the baseline, not the measurement.
    profile(model, src.batches(batch_size, d_model, batch_size), weights=False)
    before = _vm_hwm_kib()
    t0 = time.perf_counter()
    table = profile(model, src.batches(n_tokens, d_model, batch_size), weights=False)
    seconds = time.perf_counter() - t0
    state = sum(o.nbytes() for o in table.sites.values())
    return {
        "n_tokens": n_tokens,
        "observer_state_bytes": state,
        "peak_rss_kib_before": before,
        "peak_rss_kib": _vm_hwm_kib(),
        "seconds": seconds,
        "hidden_absmax": table["hidden"].absmax,
    }


def measure_memory(variant: str, d_model: int, token_counts: list[int], batch_size: int) -> list[dict]:
    rows = []
    for n in token_counts:
        cmd = [sys.executable, __file__, "--child", variant, str(d_model), str(n), str(batch_size)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return rows


def measure_throughput(variant: str, d_model: int, n_tokens: int, batch_size: int, repeats: int, threads: int | None) -> dict:
    """Forward vs profile over the same batches. With `threads` set, torch runs single/few-threaded
    and process CPU time is the measure (robust on a shared machine); otherwise wall time."""
    from ffnquant.numerics.observe import weight_stats

    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    clock = time.process_time if threads else time.perf_counter
    try:
        model = build(FFNSpec(variant, d_model=d_model), seed=0)
        batches = list(TokenSource("gaussian", seed=0).batches(n_tokens, d_model, batch_size))

        def forward() -> None:
            with torch.no_grad():
                for b in batches:
                    model(b)

        def profiled() -> None:
            profile(model, batches, weights=False)

        forward(), profiled()  # warm-up
        t_fwd, t_prof = [], []
        for _ in range(repeats):  # interleaved, so load from other processes hits both alike
            t0 = clock()
            forward()
            t_fwd.append(clock() - t0)
            t0 = clock()
            profiled()
            t_prof.append(clock() - t0)
        t0 = clock()
        for w in model.weights().values():
            weight_stats(w)
        t_w = clock() - t0
    finally:
        torch.set_num_threads(saved)
    f_med, p_med = statistics.median(t_fwd), statistics.median(t_prof)
    return {
        "variant": variant,
        "timer": f"process CPU time, {threads} torch thread(s)" if threads else f"wall clock, {saved} torch threads",
        "n_tokens": n_tokens,
        "batch_size": batch_size,
        "repeats": repeats,
        "forward_s_median": f_med,
        "forward_s_min": min(t_fwd),
        "profile_s_median": p_med,
        "profile_s_min": min(t_prof),
        "ratio_median": p_med / f_med,
        "ratio_min": min(t_prof) / min(t_fwd),
        "weight_stats_s": t_w,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "reports"))
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        v, d, n, bs = args.child
        print(json.dumps(memory_child(v, int(d), int(n), int(bs))))
        return 0

    d = 64 if args.quick else args.d_model
    small = 1024 if args.quick else 8192
    mem = measure_memory("swiglu", d, [small, 10 * small], args.batch_size)
    growth = mem[1]["peak_rss_kib"] / mem[0]["peak_rss_kib"] - 1.0
    reps = 3 if args.quick else 7
    thr = [measure_throughput(v, d, small, args.batch_size, reps, threads) for threads in (1, None) for v in ("relu", "swiglu")]
    primary = [r for r in thr if r["timer"].startswith("process")]
    load = os.getloadavg()
    result = {
        "command": "PYTHONPATH=. python benchmarks/bench_profile.py" + (" --quick" if args.quick else ""),
        "environment": environment(),
        "load_average_at_end": list(load),
        "d_model": d,
        "memory": {
            "variant": "swiglu",
            "runs": mem,
            "peak_rss_growth": growth,
            "state_bytes_equal": mem[0]["observer_state_bytes"] == mem[1]["observer_state_bytes"],
            "target": "10x tokens raises peak RSS by at most 10%",
            "met": growth <= 0.10,
        },
        "throughput": {"runs": thr, "target": "profiling <= about 2x a plain forward pass", "met": all(r["ratio_median"] <= 2.0 for r in primary),
                       "judged_by": "median ratio of process CPU time, 1 torch thread (wall clock on a shared machine is reported too)"},
    }
    out = Path(args.out)
    write_json(out / "profile_benchmark.json", result)
    md = [
        "# Profiling benchmark",
        "",
        f"Command: `{result['command']}`; d_model {d}; {result['environment']['cpu']} "
        f"({result['environment']['cpu_count']} cores, torch {result['environment']['packages']['torch']}, "
        f"{result['environment']['torch_threads']} threads); load average at the end {load[0]:.2f}. "
        ("Other processes shared the machine (load above the core count), so read the CPU-time rows. "
         if load[0] > (result["environment"]["cpu_count"] or 1) else "")
        + "Times are medians of interleaved repeats.",
        "",
        "## Memory (swiglu, streamed Gaussian tokens, fresh process per run)",
        "",
        markdown_table(
            ["tokens", "observer state (bytes)", "peak RSS (MiB)", "seconds"],
            [[r["n_tokens"], r["observer_state_bytes"], r["peak_rss_kib"] / 1024, r["seconds"]] for r in mem],
        ),
        "",
        f"10x the tokens changed peak RSS by {100 * growth:+.1f}% (target: at most +10%: "
        f"{'met' if growth <= 0.10 else 'NOT met'}); observer state "
        f"{'identical' if result['memory']['state_bytes_equal'] else 'DIFFERENT'} in size.",
        "",
        "## Throughput (profile = hooks + observers at every site; weight statistics excluded)",
        "",
        markdown_table(
            ["variant", "timer", "tokens", "forward s (median)", "profile s (median)", "ratio (median)", "ratio (best runs)", "weight stats s"],
            [[r["variant"], r["timer"], r["n_tokens"], r["forward_s_median"], r["profile_s_median"], r["ratio_median"], r["ratio_min"], r["weight_stats_s"]] for r in thr],
        ),
        "",
        f"Target: profiling at most about 2x a plain forward pass: {'met' if result['throughput']['met'] else 'NOT met'} "
        "(judged by the median ratio in single-thread process CPU time, which other processes on the "
        "machine barely disturb; the wall-clock rows show what a loaded shared machine did).",
        "",
    ]
    write_text(out / "profile_benchmark.md", "\n".join(md))
    print("\n".join(md))
    print(f"wrote {out / 'profile_benchmark.json'} and {out / 'profile_benchmark.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
