"""`plan --model` streamed a decoder layer at a time: the same plan as in memory on the trained model, and the
peak RSS of a plan on a 3B-parameter Llama checkpoint against its bytes.

    PYTHONPATH=. python benchmarks/plan_memory.py [--trained models/smollm2-135m-instruct] [--layers 28]
        [--d-model 3072] [--d-ff 8192] [--calib-tokens 512] [--eval-tokens 512] [--probe-tokens 128]
        [--max-memory 8GB] [--out reports/plan-memory]

1. The trained model (SmolLM2-135M-Instruct, `scripts/fetch_trained_llm.py`): `plan` with the whole model in
   memory (`--no-sequential`) and streamed (`--sequential`), each a child process; plan.toml and every figure of
   plan.json compared (the timings, the memory plan and the command aside), and the peak RSS of each.
2. A random-weight Llama of about 3B parameters in bf16 safetensors shards (benchmarks/scale.py writes it into a
   temporary folder): `plan` under `--max-memory`, which the whole model in float32 does not fit, so it streams;
   its peak RSS against the checkpoint's bytes and its seconds per layer by stage.

Peak RSS is the kernel's high-water mark of the command's process (scale.measure). Writes plan_memory.json/.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale import ROOT, measure, write_checkpoints  # noqa: E402

from ffnquant.infra.atomic import write_json, write_text  # noqa: E402
from ffnquant.infra.envinfo import environment  # noqa: E402
from ffnquant.infra.render import markdown_table  # noqa: E402
from ffnquant.infra.resources import human_bytes  # noqa: E402

# what two runs of the same plan may differ in: how long they took, how they ran, how they were called
_VOLATILE = ("timings", "memory", "streamed", "command", "environment")


def _plan_files(folder: Path) -> tuple[str, dict]:
    toml = "\n".join(ln for ln in (folder / "plan.toml").read_text().splitlines() if not ln.startswith("# made by"))
    data = json.loads((folder / "plan.json").read_text())
    return toml, {k: v for k, v in data.items() if k not in _VOLATILE}


def _differences(a, b, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in dict.fromkeys([*a, *b]) for d in _differences(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def _run(cmd: list[str], env: dict[str, str], out: Path) -> dict:
    r = measure(cmd, env)
    r.pop("lines")
    if r["rc"] == 0:
        data = json.loads((out / "plan.json").read_text())
        r.update(timings=data["timings"], memory_plan=data["memory"], verified=data["verified"],
                 plan={row["index"]: row["recipe"] for row in data["plan"]["layers"]})
    print(f"{r['command'][:120]}: rc {r['rc']}, {r['seconds']:.0f} s, peak RSS {human_bytes(r['peak_rss_bytes'])}",
          flush=True)
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trained", default="models/smollm2-135m-instruct")
    ap.add_argument("--candidates", default="default", help="the trained model's candidate set")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--d-model", type=int, default=3072)
    ap.add_argument("--d-ff", type=int, default=8192)
    ap.add_argument("--calib-tokens", type=int, default=512)
    ap.add_argument("--eval-tokens", type=int, default=512)
    ap.add_argument("--probe-tokens", type=int, default=128)
    ap.add_argument("--scale-candidates", default="fp32,w8a8-dynamic-s8,w8a16,w4a16-g128")
    ap.add_argument("--max-memory", default="8GB")
    ap.add_argument("--skip", choices=("trained", "scale"), action="append", default=[])
    ap.add_argument("--out", default="reports/plan-memory")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    base = [sys.executable, "-m", "ffnquant", "plan", "--objective", "bytes", "--no-progress"]
    res: dict = {"command": "PYTHONPATH=. python benchmarks/plan_memory.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    with tempfile.TemporaryDirectory(prefix="ffnquant-plan-memory-") as tmp:
        if "trained" not in args.skip and Path(args.trained).is_dir():
            runs = {}
            for mode in ("--no-sequential", "--sequential"):
                out = Path(tmp) / mode.strip("-")
                runs[mode] = _run(base + ["--model", args.trained, "--candidates", args.candidates, mode,
                                          "--out", str(out)], env, out)
            same = all(r["rc"] == 0 for r in runs.values())
            diffs = []
            if same:
                (ta, ja), (tb, jb) = (_plan_files(Path(tmp) / m.strip("-")) for m in runs)
                diffs = (["plan.toml differs"] if ta != tb else []) + _differences(ja, jb)
            res["trained"] = {"model": args.trained, "candidates": args.candidates, "runs": runs, "compared": same, "differences": diffs[:20],
                              "n_differences": len(diffs)}
        elif "trained" not in args.skip:
            res["trained"] = {"model": args.trained, "skipped": "not found: python scripts/fetch_trained_llm.py"}
        if "scale" not in args.skip:
            t = time.perf_counter()
            heads = max(1, args.d_model // 128)  # scale.py's shape: 24 heads of 128, 8 key/value heads at 3072
            folders = write_checkpoints(Path(tmp) / "ckpt", args.layers, args.d_model, args.d_ff, heads, min(8, heads),
                                        32000, math.gcd(7, args.layers // 2))
            write_seconds = time.perf_counter() - t
            folder = folders[args.layers]
            size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
            out = Path(tmp) / "scale-plan"
            r = _run(base + ["--model", str(folder), "--candidates", args.scale_candidates, "--no-ort-floor",
                             "--calib-tokens", str(args.calib_tokens), "--eval-tokens", str(args.eval_tokens),
                             "--probe-tokens", str(args.probe_tokens), "--max-memory", args.max_memory,
                             "--out", str(out)], env, out)
            r["command"] = r["command"].replace(str(folder), "CHECKPOINT").replace(tmp, "TMP")
            res["scale"] = {"layers": args.layers, "d_model": args.d_model, "d_ff": args.d_ff,
                            "checkpoint_bytes": size, "write_seconds": write_seconds, "run": r,
                            "rss_share": r["peak_rss_bytes"] / size, "seconds_per_layer": r["seconds"] / args.layers}
    res["seconds"] = time.perf_counter() - started
    res["environment"] = environment()
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "plan_memory.json", res)
    write_text(folder / "plan_memory.md", _markdown(res))
    print(_markdown(res))
    ok = all(r["rc"] == 0 for r in res.get("trained", {}).get("runs", {}).values())
    ok = ok and res.get("scale", {}).get("run", {}).get("rc", 0) == 0
    return 0 if ok and not res.get("trained", {}).get("n_differences") else 1


def _timing_row(label: str, r: dict) -> tuple:
    t = r.get("timings") or {}
    return (label, human_bytes(r["peak_rss_bytes"]), f"{r['seconds']:.0f}",
            *(f"{t[k]:.0f}" if k in t else "-" for k in ("capture_s", "gradients_s", "candidates_s", "verify_s")),
            (r.get("memory_line") or "-").removeprefix("memory: "), "ok" if r["rc"] == 0 else f"exit {r['rc']}")


def _markdown(res: dict) -> str:
    env = res["environment"]
    lines = ["# plan --model a decoder layer at a time", "", f"Command: `{res['command'].strip()}`", ""]
    head = ["run", "peak RSS", "seconds", "forward s", "gradients s", "candidates s", "verify s", "memory plan",
            "status"]
    tr = res.get("trained")
    if tr and "skipped" in tr:
        lines += [f"Trained model: skipped ({tr['skipped']}).", ""]
    elif tr:
        rows = [_timing_row(f"`{m}`", r) for m, r in tr["runs"].items()]
        verdict = ("plan.toml and every figure of plan.json are the same" if tr["compared"] and not tr["n_differences"]
                   else f"{tr['n_differences']} differences: " + "; ".join(tr["differences"][:5]) if tr["compared"]
                   else "not compared: a run failed")
        lines += [f"## The trained model, in memory and streamed: {tr['model']}", "",
                  f"`ffnquant plan --model M --objective bytes --candidates {tr['candidates']}` (target ppl+1%, the "
                  "shipped search and held-out texts), once with the whole model in memory and once a decoder layer "
                  "at a time:",
                  "", markdown_table(head, rows), "", f"Compared (timings, memory plan and command aside): {verdict}.", ""]
    sc = res.get("scale")
    if sc:
        r = sc["run"]
        per = {k: r["timings"][k] / sc["layers"] for k in ("capture_s", "gradients_s", "candidates_s", "verify_s")} \
            if r.get("timings") else {}
        lines += [f"## A random-weight Llama: {sc['layers']} layers, d_model {sc['d_model']}, d_ff {sc['d_ff']}", "",
                  f"{human_bytes(sc['checkpoint_bytes'])} of bf16 safetensors shards (written in "
                  f"{sc['write_seconds']:.0f} s). `{r['command']}`:", "",
                  markdown_table(head, [_timing_row("layer by layer" if (r.get("memory_plan") or {}).get("sequential")
                                                    else "whole model", r)]), "",
                  f"Peak RSS {human_bytes(r['peak_rss_bytes'])}: {100 * sc['rss_share']:.1f}% of the checkpoint's bytes; "
                  f"{sc['seconds_per_layer']:.1f} s per layer in all"
                  + (" (" + ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in per.items()) + " per layer)"
                     if per else "") + ".", ""]
        if r.get("plan") is not None:
            lines += [f"The plan: {json.dumps(r['plan'])} (verified: {r.get('verified')}; random weights, so the plan "
                      "itself says nothing about real models).", ""]
    lines += [f"_{env.get('timestamp_utc')} on {env.get('cpu')} ({os.cpu_count()} cores), torch "
              f"{env['packages'].get('torch')}, transformers {env['packages'].get('transformers', '-')}; "
              f"{res['seconds'] / 60:.0f} min in all._", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
